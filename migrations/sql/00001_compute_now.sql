-- +goose Up
-- compute_now() is the one clock every lease comparison uses. Production reads
-- the database server's clock; benches may replace the function with a scaled
-- clock (docs/design.md#time), so nothing may inline clock_timestamp() instead.
-- +goose StatementBegin
CREATE FUNCTION compute_now() RETURNS timestamptz
LANGUAGE sql VOLATILE PARALLEL SAFE
AS $$ SELECT clock_timestamp() $$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION compute_now();
