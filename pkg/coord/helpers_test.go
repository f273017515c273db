package coord_test

import (
	"context"

	"github.com/jackc/pgx/v5"

	"github.com/leasehold/leasehold/pkg/pgdb"
)

func pgdbInTx(ctx context.Context, tx pgx.Tx, fn func(pgx.Tx) error) error {
	return pgdb.InTx(ctx, tx, fn)
}
