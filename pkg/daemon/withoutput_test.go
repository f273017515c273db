package daemon

import (
	"bytes"
	"context"
	"io"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestWithOutput: Stdout and Stderr of a WithOutput ctx are its writers; a
// plain ctx discards.
func TestWithOutput(t *testing.T) {
	t.Parallel()
	require.Equal(t, io.Discard, Stdout(context.Background()))
	var out, errOut bytes.Buffer
	ctx := WithOutput(context.Background(), &out, &errOut)
	_, _ = Stdout(ctx).Write([]byte("o"))
	_, _ = Stderr(ctx).Write([]byte("e"))
	require.Equal(t, "o", out.String())
	require.Equal(t, "e", errOut.String())
}
