package process_test

import (
	"context"
	"flag"
	"io"
	"os"
	"strings"
	"testing"

	"github.com/grafana/dskit/services"

	"github.com/leasehold/leasehold/pkg/lifecycle"
	"github.com/leasehold/leasehold/pkg/process"
	"github.com/leasehold/leasehold/pkg/reconcile"
)

// FuzzRun feeds process.Run random command lines and one random LEASEHOLD_*
// variable, with the flags of a real reconcile-runtime service. The context
// is already cancelled, so a configuration that validates stops at the
// schema check (exit 1) and nothing ever starts: Build must never run. Run
// must never panic, must exit 2 with a message for a bad configuration, and
// 1 otherwise.
func FuzzRun(f *testing.F) {
	seeds := []struct{ args, env, val string }{
		{"--database-url postgres://u:p@127.0.0.1:1/db", "", ""},
		{"--database-url=postgres://x --pooler --listen-database-url postgres://y", "", ""},
		{"", "DATABASE_URL", "postgres://127.0.0.1:1/x"},
		{"--database-url x --db-max-conns 0", "", ""},
		{"--database-url x --coord.lease-ttl 1s --coord.renew-interval 900ms", "", ""},
		{"--database-url x --coord.lease-ttl 1.5ms", "", ""},
		{"--database-url x --id bad\tid", "", ""},
		{"--database-url x --log-level loud", "", ""},
		{"--database-url x", "LOG_FORMAT", "xml"},
		{"--database-url x", "COORD_LEASE_TTL", "-3s"},
		{"--database-url x", "POOLER", "maybe"},
		{"-h", "", ""},
		{"--no-such-flag", "", ""},
		{"--database-url x --shutdown-timeout 0s extra positional", "", ""},
		{"--database-url x --http-addr ''", "", ""},
	}
	for _, s := range seeds {
		f.Add(s.args, s.env, s.val)
	}
	stderr, err := os.CreateTemp(f.TempDir(), "stderr")
	if err != nil {
		f.Fatal(err)
	}
	defer stderr.Close()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	f.Fuzz(func(t *testing.T, args, envName, envValue string) {
		if envName != "" {
			name := lifecycle.EnvName(strings.ToLower(envName))
			if strings.ContainsAny(name, "=\x00") || strings.ContainsRune(envValue, 0) {
				return
			}
			t.Setenv(name, envValue)
		}
		cfg := reconcile.DefaultConfig()
		spec := process.Spec{
			Name: "fuzzsvc", HTTPAddr: "127.0.0.1:0",
			Flags:    func(fs *flag.FlagSet) { cfg.RegisterFlags("coord.", fs) },
			Validate: cfg.Validate,
			Build: func(context.Context, *process.Process) ([]services.Service, error) {
				t.Fatalf("Build ran for %q", args)
				return nil, nil
			},
		}
		if err := stderr.Truncate(0); err != nil {
			t.Fatal(err)
		}
		if _, err := stderr.Seek(0, io.SeekStart); err != nil {
			t.Fatal(err)
		}
		code := process.Run(ctx, spec, strings.Fields(args), stderr)
		out, _ := os.ReadFile(stderr.Name())
		switch code {
		case 2:
			if len(strings.TrimSpace(string(out))) == 0 {
				t.Fatalf("exit 2 without a message for %q", args)
			}
		case 1:
			if !strings.Contains(string(out), "exiting after failure") {
				t.Fatalf("exit 1 without the failure logged for %q: %s", args, out)
			}
		default:
			t.Fatalf("Run(%q) = %d with a cancelled context; want 1 or 2", args, code)
		}
	})
}
