package daemon

import (
	"bytes"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jonboulle/clockwork"
	"github.com/stretchr/testify/require"
)

// TestFailedDialsAreLoggedSparingly: a daemon that cannot open a session
// warns on the first failed dial with the error, then at most once a
// minute while the failures go on, and again at once after a session
// succeeded in between. Pushbacks and drains are not failures.
func TestFailedDialsAreLoggedSparingly(t *testing.T) {
	var logs bytes.Buffer
	clk := clockwork.NewFakeClock()
	d := &Daemon{cfg: Config{Address: "https://gw.example:9443"}, clock: clk, log: slog.New(slog.NewTextHandler(&logs, nil))}
	refused := sessionEnd{err: errors.New("tls: certificate required")}
	warnings := func() int { return strings.Count(logs.String(), "cannot open a session with the gateway") }

	d.warnFailedDial(refused, time.Second)
	require.Equal(t, 1, warnings())
	require.Contains(t, logs.String(), "tls: certificate required")
	require.Contains(t, logs.String(), "https://gw.example:9443")
	for range 10 {
		clk.Advance(5 * time.Second)
		d.warnFailedDial(refused, time.Second)
	}
	require.Equal(t, 1, warnings(), "50 s of failures: no second warning yet")
	clk.Advance(15 * time.Second)
	d.warnFailedDial(refused, time.Second)
	require.Equal(t, 2, warnings(), "a minute on, the failures are reported again")
	require.Contains(t, logs.String(), "failed_dials=12")

	d.warnFailedDial(sessionEnd{pushback: true}, time.Second)
	d.warnFailedDial(sessionEnd{welcomed: true, lasted: time.Hour, err: errors.New("stream reset")}, time.Second)
	require.Equal(t, 2, warnings(), "a pushback or a session that was up is not a failed dial")
	d.warnFailedDial(refused, time.Second)
	require.Equal(t, 3, warnings(), "the first failure after a session is reported at once")
}
