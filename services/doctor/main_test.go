package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/coord"
	doctorv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/doctor/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/doctor/v1/doctorv1connect"
	"github.com/leasehold/leasehold/pkg/pglocal"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/proctest"
	"github.com/leasehold/leasehold/services/doctor/internal/doctor"
	"github.com/leasehold/leasehold/services/doctor/internal/fixture"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

type jsonReport struct {
	CheckedAt string `json:"checked_at"`
	Status    string `json:"status"`
	ExitCode  int    `json:"exit_code"`
	Error     string `json:"error"`
	Findings  []struct {
		Code     string            `json:"code"`
		Severity string            `json:"severity"`
		Summary  string            `json:"summary"`
		Evidence []doctor.Evidence `json:"evidence"`
		Hint     string            `json:"hint"`
		Checked  bool              `json:"checked"`
		Reason   string            `json:"reason"`
	} `json:"findings"`
}

// runCLI runs the doctor binary with stdout on a pipe (not a terminal).
func runCLI(t *testing.T, dbURL string, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	bin := proctest.Build(t, ".")
	cmd := exec.Command(bin, args...)
	cmd.Env = []string{"LEASEHOLD_DATABASE_URL=" + dbURL, "TERM=xterm-256color", "PATH=/usr/bin:/bin"}
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	if ee := (*exec.ExitError)(nil); errors.As(err, &ee) {
		return ee.ExitCode(), out.String(), errb.String()
	}
	require.NoError(t, err)
	return 0, out.String(), errb.String()
}

func parseJSON(t *testing.T, s string) jsonReport {
	t.Helper()
	var r jsonReport
	require.NoError(t, json.Unmarshal([]byte(s), &r), s)
	return r
}

func severityOf(r jsonReport, code string) string {
	for _, f := range r.Findings {
		if f.Code == code {
			return f.Severity
		}
	}
	return ""
}

func TestCheckExitCodesTableAndJSON(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	// Build first: the fixture's heartbeats and leases must still be fresh
	// when the doctor runs, however long a busy machine takes to build.
	proctest.Build(t, ".")
	fixture.Healthy(t, db.Pool)

	// Healthy: exit 0, a table without colour on a pipe.
	code, out, errOut := runCLI(t, db.URL)
	require.Equal(t, 0, code, out+errOut)
	require.Contains(t, out, "STATUS")
	require.Contains(t, out, "workers.queue")
	require.Contains(t, out, fmt.Sprintf("%d ok, 0 warn, 0 critical, 0 not checked: ok", len(doctor.Codes())))
	require.NotContains(t, out, "\x1b[", "no ANSI colour when stdout is not a terminal")

	code, out, _ = runCLI(t, db.URL, "check", "--json")
	require.Equal(t, 0, code)
	r := parseJSON(t, out)
	require.Equal(t, "ok", r.Status)
	require.Equal(t, 0, r.ExitCode)
	require.Len(t, r.Findings, len(doctor.Codes()))
	for _, f := range r.Findings {
		require.Equal(t, "ok", f.Severity, f.Code)
		require.True(t, f.Checked)
	}
	require.NotEmpty(t, r.CheckedAt)

	// Warn: a worker reports clock skew.
	fixture.Exec(t, db.Pool, `UPDATE workers SET clock_skew_ms = 4000 WHERE id = 'w-b'`)
	code, out, _ = runCLI(t, db.URL, "--json")
	require.Equal(t, 1, code, out)
	r = parseJSON(t, out)
	require.Equal(t, "warn", r.Status)
	require.Equal(t, "warn", severityOf(r, doctor.CodeLeasesClockSkew))
	code, out, _ = runCLI(t, db.URL)
	require.Equal(t, 1, code)
	t.Logf("table:\n%s", out)
	require.Contains(t, out, "WARN     leases.clock_skew")
	require.Contains(t, out, "hint: synchronise")

	// Critical: stop all workers (no heartbeats) with work 10 minutes late.
	fixture.Exec(t, db.Pool, `DELETE FROM workers`)
	fixture.Exec(t, db.Pool, `UPDATE work_queue SET due_at = compute_now() - interval '10 minutes'`)
	code, out, _ = runCLI(t, db.URL, "--json", "--codes", "workers.queue,db.version")
	require.Equal(t, 2, code, out)
	r = parseJSON(t, out)
	require.Equal(t, "critical", r.Status)
	require.Len(t, r.Findings, 2)
	require.Contains(t, r.Findings[1].Summary, "and no worker is alive")

	// Colour only when asked for (or on a terminal).
	code, out, _ = runCLI(t, db.URL, "--color", "always", "--codes", "workers.queue")
	require.Equal(t, 2, code)
	require.Contains(t, out, "\x1b[1;31mCRIT")

	// Usage errors could not check anything: 3, never 2 (critical).
	code, _, errOut = runCLI(t, db.URL, "--codes", "no.such")
	require.Equal(t, 3, code)
	require.Contains(t, errOut, `unknown finding code(s) no.such`)
	code, _, errOut = runCLI(t, db.URL, "--max-streams", "0")
	require.Equal(t, 3, code)
	require.Contains(t, errOut, "--max-streams 0 must be at least 1")
	code, _, errOut = runCLI(t, db.URL, "--no-such-flag")
	require.Equal(t, 3, code)
	require.Contains(t, errOut, "flag provided but not defined: -no-such-flag")
	code, _, errOut = runCLI(t, db.URL, "frobnicate")
	require.Equal(t, 3, code)
	require.Contains(t, errOut, `unknown command "frobnicate"`)
	code, out, _ = runCLI(t, db.URL, "codes")
	require.Equal(t, 0, code)
	require.Equal(t, strings.Join(doctor.Codes(), "\n")+"\n", out)
}

// TestCheckUnreachableDatabaseCouldNotCheck: a doctor that cannot reach
// the database says so with exit 3 ("could not check"), not 2 (a critical
// finding it never made) and not 0.
func TestCheckUnreachableDatabaseCouldNotCheck(t *testing.T) {
	t.Parallel()
	port, err := pglocal.FreePort()
	require.NoError(t, err)
	url := fmt.Sprintf("postgres://postgres:postgres@127.0.0.1:%d/x?sslmode=disable&connect_timeout=2", port)
	code, out, errOut := runCLI(t, url, "--json")
	require.Equal(t, 3, code)
	r := parseJSON(t, out)
	require.Equal(t, "unknown", r.Status)
	require.Equal(t, 3, r.ExitCode)
	require.Contains(t, r.Error, "cannot reach the database")
	require.Contains(t, errOut, "cannot reach the database")
	code, _, errOut = runCLI(t, url)
	require.Equal(t, 3, code)
	require.Contains(t, errOut, "cannot reach the database")
}

// TestHelpAndVersionNeedNoDatabase: the top-level help lists the commands,
// and --version / version print the build, all without a database.
func TestHelpAndVersionNeedNoDatabase(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{{"--help"}, {"-h"}, {"help"}} {
		code, out, _ := runCLI(t, "", args...)
		require.Equal(t, 0, code, args)
		for _, cmd := range []string{"check", "serve", "codes", "version"} {
			require.Contains(t, out, "leasehold-doctor "+cmd, "%v lists %s", args, cmd)
		}
		require.Contains(t, out, "3 could not check")
	}
	for _, args := range [][]string{{"--version"}, {"version"}, {"check", "--version"}} {
		code, out, _ := runCLI(t, "", args...)
		require.Equal(t, 0, code, args)
		require.Regexp(t, `^leasehold-doctor \S+ \(revision \S+, go\S+\)\n$`, out, args)
	}
}

func TestServeDoctorServiceAndMetrics(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	proctest.Build(t, ".") // before the fixture, as above
	fixture.Healthy(t, db.Pool)
	// A critical state: every gateway gone while nodes are registered.
	fixture.Exec(t, db.Pool, `DELETE FROM leases WHERE name LIKE 'gateway:%'`)
	fixture.Worker(t, db.Pool, "w-a", coord.Controllers.Name, 0, "listen")

	httpPort, err := pglocal.FreePort()
	require.NoError(t, err)
	apiPort, err := pglocal.FreePort()
	require.NoError(t, err)
	bin := proctest.Build(t, ".")
	// The daemon's pool caches statements unless given --pooler: give it
	// the direct URL even when the suite runs through PgBouncer.
	direct := fixture.DirectURL(pgtest.Server(t).AdminURL(), db.Name)
	p := proctest.Start(t, "doctor", bin, []string{"LEASEHOLD_DATABASE_URL=" + direct},
		"serve", "--http-addr", fmt.Sprintf("127.0.0.1:%d", httpPort), "--listen-addr", fmt.Sprintf("127.0.0.1:%d", apiPort),
		"--interval", "1s", "--api-token", "secret", "--health-token", "tok", "--log-format", "text")
	p.WaitReady(30 * time.Second)

	base := fmt.Sprintf("http://127.0.0.1:%d", apiPort)
	client := doctorv1connect.NewDoctorServiceClient(http.DefaultClient, base)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	_, err = client.Check(ctx, connect.NewRequest(&doctorv1.CheckRequest{}))
	require.Equal(t, connect.CodeUnauthenticated, connect.CodeOf(err), "%v", err)

	authed := func(m *doctorv1.CheckRequest) *connect.Request[doctorv1.CheckRequest] {
		req := connect.NewRequest(m)
		req.Header().Set("Authorization", "Bearer secret")
		return req
	}
	resp, err := client.Check(ctx, authed(&doctorv1.CheckRequest{}))
	require.NoError(t, err)
	require.Len(t, resp.Msg.GetFindings(), len(doctor.Codes()))
	require.NotNil(t, resp.Msg.GetCheckedAt())
	for i, f := range resp.Msg.GetFindings() {
		require.Equal(t, doctor.Codes()[i], f.GetCode())
		want := doctorv1.Severity_SEVERITY_OK
		if f.GetCode() == doctor.CodeGatewaysNone {
			want = doctorv1.Severity_SEVERITY_CRITICAL
		}
		require.Equal(t, want, f.GetSeverity(), "%s: %s", f.GetCode(), f.GetSummary())
		require.True(t, f.GetChecked())
	}

	resp, err = client.Check(ctx, authed(&doctorv1.CheckRequest{Codes: []string{doctor.CodeGatewaysNone}}))
	require.NoError(t, err)
	require.Len(t, resp.Msg.GetFindings(), 1)
	require.NotEmpty(t, resp.Msg.GetFindings()[0].GetHint())
	require.NotEmpty(t, resp.Msg.GetFindings()[0].GetEvidence())

	_, err = client.Check(ctx, authed(&doctorv1.CheckRequest{Codes: []string{"no.such"}}))
	require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err), "%v", err)

	// gRPC health over the Connect protocol.
	hreq, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/grpc.health.v1.Health/Check", strings.NewReader(`{"service":"leasehold.doctor.v1.DoctorService"}`))
	require.NoError(t, err)
	hreq.Header.Set("Content-Type", "application/json")
	hresp, err := http.DefaultClient.Do(hreq)
	require.NoError(t, err)
	var health struct{ Status string }
	require.NoError(t, json.NewDecoder(hresp.Body).Decode(&health))
	hresp.Body.Close()
	require.Equal(t, "SERVING_STATUS_SERVING", health.Status)

	// One gauge per finding, refreshed on the interval.
	require.Eventually(t, func() bool {
		_, body, err := p.Get("/metrics", "")
		return err == nil && strings.Contains(body, `leasehold_doctor_finding{code="gateways.none"} 2`) &&
			strings.Contains(body, `leasehold_doctor_finding{code="workers.sweeper"} 0`)
	}, 20*time.Second, 100*time.Millisecond)
	fixture.Lease(t, db.Pool, "gateway:gw-a", "gw-a", 2, 60)
	require.Eventually(t, func() bool {
		_, body, err := p.Get("/metrics", "")
		return err == nil && strings.Contains(body, `leasehold_doctor_finding{code="gateways.none"} 0`)
	}, 20*time.Second, 100*time.Millisecond)
	_, body, err := p.Get("/metrics", "")
	require.NoError(t, err)
	for _, c := range doctor.Codes() {
		require.Contains(t, body, fmt.Sprintf(`leasehold_doctor_finding{code=%q}`, c))
	}
	code, detail, err := p.Get("/healthz/detail", "tok")
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, detail, `"findings"`)

	p.Signal(syscall.SIGTERM)
	require.Equal(t, 0, p.Wait(30*time.Second), p.Logs())
	require.Contains(t, p.Logs(), "stopped cleanly")
}
