package main

import (
	"fmt"
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/pglocal"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/proctest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// TestEveryServiceStartsServesHealthAndStopsOnSIGTERM runs each service
// binary that connects to the database as a real process against a real
// database. (The site agent is a node, not a database client: its own tests
// run it against a gateway.)
func TestEveryServiceStartsServesHealthAndStopsOnSIGTERM(t *testing.T) {
	db := pgtest.NewEmpty(t)
	for i, name := range []string{"worker", "scheduler", "gateway", "api", "doctor"} {
		t.Run(name, func(t *testing.T) {
			bin := proctest.Build(t, "../../services/"+name)
			port, err := pglocal.FreePort()
			require.NoError(t, err)
			args := []string{"--http-addr", fmt.Sprintf("127.0.0.1:%d", port), "--health-token", "tok"}
			if i == 0 {
				args = append(args, "--migrate") // the first one migrates the empty database
			}
			if name == "gateway" || name == "api" {
				listen, err := pglocal.FreePort()
				require.NoError(t, err)
				args = append(args, "--listen-addr", fmt.Sprintf("127.0.0.1:%d", listen))
			}
			args = append(args, pgtest.PoolerFlags(db.URL)...)
			if name == "doctor" {
				// doctor is a CLI; its daemon is `leasehold-doctor serve`,
				// with DoctorService on a port of its own.
				apiPort, err := pglocal.FreePort()
				require.NoError(t, err)
				args = append([]string{"serve", "--listen-addr", fmt.Sprintf("127.0.0.1:%d", apiPort)}, args...)
			}
			env := []string{"LEASEHOLD_DATABASE_URL=" + db.URL, "LEASEHOLD_API_TOKENS=admin:devstack-test-token-0123"}
			p := proctest.Start(t, name, bin, env, args...)
			p.WaitReady(30 * time.Second)
			code, _, err := p.Get("/livez", "")
			require.NoError(t, err)
			require.Equal(t, http.StatusOK, code)
			code, body, err := p.Get("/metrics", "")
			require.NoError(t, err)
			require.Equal(t, http.StatusOK, code)
			require.Contains(t, body, "process_cpu_seconds_total")
			code, _, err = p.Get("/healthz/detail", "")
			require.NoError(t, err)
			require.Equal(t, http.StatusUnauthorized, code)
			code, _, err = p.Get("/healthz/detail", "tok")
			require.NoError(t, err)
			require.Equal(t, http.StatusOK, code)

			p.Signal(syscall.SIGTERM)
			require.Equal(t, 0, p.Wait(30*time.Second), p.Logs())
			require.True(t, strings.Contains(p.Logs(), "stopped cleanly"), p.Logs())
		})
	}
}
