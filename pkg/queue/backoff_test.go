package queue

import (
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/stretchr/testify/require"
)

func TestBackoffCapDoublesToMax(t *testing.T) {
	t.Parallel()
	b := Backoff{Base: time.Second, Max: 10 * time.Second}
	want := []time.Duration{time.Second, time.Second, 2 * time.Second, 4 * time.Second, 8 * time.Second, 10 * time.Second, 10 * time.Second}
	for attempts, w := range want {
		require.Equal(t, w, b.Cap(attempts), "attempts %d", attempts)
	}
	require.Equal(t, 10*time.Second, b.Cap(1<<30), "no overflow")
	huge := Backoff{Base: 1 << 61, Max: 1<<63 - 1}
	require.Equal(t, time.Duration(1<<63-1), huge.Cap(5))
	require.Equal(t, DefaultBackoffBase, Backoff{}.Cap(1))
	require.Equal(t, DefaultBackoffMax, Backoff{}.Cap(100))
}

func TestBackoffDelayIsFullJitter(t *testing.T) {
	t.Parallel()
	for _, r := range []float64{0, 0.25, 0.5, 0.999999} {
		b := Backoff{Base: time.Second, Max: time.Minute, Rand: func() float64 { return r }}
		for attempts := 1; attempts < 10; attempts++ {
			d := b.Delay(attempts)
			c := b.Cap(attempts)
			require.GreaterOrEqual(t, d, time.Duration(0))
			require.LessOrEqual(t, d, c)
			require.InDelta(t, r*float64(c), float64(d), float64(time.Millisecond))
		}
	}
	// The default source stays in range.
	for range 1000 {
		d := Backoff{}.Delay(3)
		require.GreaterOrEqual(t, d, time.Duration(0))
		require.LessOrEqual(t, d, 4*time.Second)
	}
}

func TestBackoffValidate(t *testing.T) {
	t.Parallel()
	require.NoError(t, Backoff{}.Validate())
	require.NoError(t, Backoff{Base: time.Second, Max: time.Second}.Validate())
	require.Error(t, Backoff{Base: time.Minute, Max: time.Second}.Validate())
	require.Error(t, Backoff{Base: -time.Second}.Validate())
}

func TestTruncateError(t *testing.T) {
	t.Parallel()
	require.Equal(t, "short", truncateError("short"))
	require.Equal(t, "a\uFFFDb\uFFFDc", truncateError("a\x00b\xffc"))
	long := truncateError(strings.Repeat("€", 1000)) // 3 bytes a rune
	require.LessOrEqual(t, len(long), MaxErrorLen)
	require.True(t, utf8.ValidString(long))
	require.True(t, strings.HasSuffix(long, "…(truncated)"))
	exact := strings.Repeat("x", MaxErrorLen)
	require.Equal(t, exact, truncateError(exact))
}
