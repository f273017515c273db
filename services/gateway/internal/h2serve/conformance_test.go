package h2serve

import (
	"bytes"
	"context"
	"encoding/xml"
	"errors"
	"io"
	"maps"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// h2specEnv names the h2spec binary that TestH2spec runs (`make h2spec`
// builds it from the version pinned in tools/h2spec and sets it).
const h2specEnv = "LEASEHOLD_H2SPEC"

// zeroTableFailures are the h2spec cases the lean server fails with no
// HPACK dynamic table (HeaderTableSize 0, the gateway's setting) although
// net/http passes them, each with the reason (listed in docs/gateway.md,
// "HTTP/2 conformance"). h2spec encodes its headers against a 4 KiB table
// whatever SETTINGS_HEADER_TABLE_SIZE the server sent and acknowledged;
// refusing the larger table is what RFC 7541 sections 4.2 and 6.3 require.
// With a 4 KiB table the lean server passes them (TestH2spec checks both).
var zeroTableFailures = map[string]string{
	"generic/5/14: Sends a dynamic table size update":                              "table size update to 128 above the advertised 0: COMPRESSION_ERROR",
	"generic/5/15: Sends multiple dynamic table size update":                       "table size update to 4096 above the advertised 0: COMPRESSION_ERROR",
	"http2/6.10/1: Sends multiple CONTINUATION frames preceded by a HEADERS frame": "the second CONTINUATION refers to a dynamic table entry the advertised 0-byte table never held: COMPRESSION_ERROR",
}

// conformanceHandler answers every request plainly: it reads the whole
// body (so a content-length that disagrees with the DATA is noticed, as
// h2spec's section 8.1.2.6 expects) and writes a short body.
func conformanceHandler(w http.ResponseWriter, r *http.Request) {
	if _, err := io.Copy(io.Discard, r.Body); err != nil {
		return
	}
	w.Header().Set("Content-Type", "text/plain")
	_, _ = io.WriteString(w, "ok\n")
}

// TestH2spec runs the h2spec conformance suite (RFC 7540 and RFC 7541,
// strict cases included) against the lean server and against net/http's
// HTTP/2 server, both with the same trivial handler over h2c, and fails
// when the lean server fails a case net/http passes (outside
// leanKnownFailures). It is skipped unless LEASEHOLD_H2SPEC names the
// h2spec binary.
func TestH2spec(t *testing.T) {
	bin := os.Getenv(h2specEnv)
	if bin == "" {
		t.Skipf("%s is not set: `make h2spec` runs the HTTP/2 conformance suite", h2specEnv)
	}
	std := runH2spec(t, bin, "std", serveStdH2C(t))
	require.Greater(t, len(std), 100, "h2spec ran too few cases")
	t.Logf("h2spec: %d cases; net/http fails %q", len(std), failed(std))

	// With the 4 KiB table h2spec assumes, every case net/http passes.
	lean := runH2spec(t, bin, "lean", serveLeanH2C(t, 4096))
	checkAgainstStd(t, "lean (HeaderTableSize 4096)", std, lean, nil)
	// As the gateway runs it: no dynamic table.
	gw := runH2spec(t, bin, "lean-gateway", serveLeanH2C(t, 0))
	checkAgainstStd(t, "lean (HeaderTableSize 0)", std, gw, zeroTableFailures)
}

// failed lists the ids of the failed cases, sorted.
func failed(cases map[string]string) []string {
	var ids []string
	for _, id := range slices.Sorted(maps.Keys(cases)) {
		if cases[id] != "" {
			ids = append(ids, id)
		}
	}
	return ids
}

// checkAgainstStd fails the test when lean fails a case std passes, unless
// the case is in known; and when a known case no longer fails.
func checkAgainstStd(t *testing.T, name string, std, lean, known map[string]string) {
	t.Helper()
	// Both runs saw the same suite: a run that stopped early passes nothing.
	require.Equal(t, slices.Sorted(maps.Keys(std)), slices.Sorted(maps.Keys(lean)), "h2spec ran different cases against net/http and %s", name)
	t.Logf("h2spec: %s fails %q", name, failed(lean))
	var regressions []string
	for _, id := range failed(lean) {
		if std[id] == "" && known[id] == "" {
			regressions = append(regressions, id+"\n    "+lean[id])
		}
	}
	for id := range known {
		if lean[id] == "" {
			t.Errorf("%s: known failure %q passes now: remove it from the list and from docs/gateway.md", name, id)
		}
	}
	if len(regressions) > 0 {
		t.Errorf("%s fails %d h2spec cases that net/http passes:\n  %s", name, len(regressions), strings.Join(regressions, "\n  "))
	}
}

// runH2spec runs h2spec against addr and returns every case by id, mapped
// to its failure message ("" when it passed).
func runH2spec(t *testing.T, bin, name, addr string) map[string]string {
	t.Helper()
	host, port, err := net.SplitHostPort(addr)
	require.NoError(t, err)
	report := filepath.Join(t.TempDir(), name+".xml")
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Minute)
	defer cancel()
	// -o is how long a case waits for the server's answer: generous, as
	// the machine may be busy; a passing case does not wait for it.
	cmd := exec.CommandContext(ctx, bin, "--strict", "-h", host, "-p", port, "-o", "10", "-j", report)
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	if err != nil && !errors.As(err, &exit) { // h2spec exits 1 when a case fails
		t.Fatalf("h2spec against %s: %v\n%s", name, err, out)
	}
	t.Logf("h2spec against %s:\n%s", name, out)
	b, err := os.ReadFile(report)
	require.NoError(t, err, "h2spec wrote no report")
	var r struct {
		Suites []struct {
			Package string `xml:"package,attr"`
			Cases   []struct {
				Desc    string  `xml:"classname,attr"`
				Failure *string `xml:"failure"`
				Error   *string `xml:"error"`
			} `xml:"testcase"`
		} `xml:"testsuite"`
	}
	require.NoError(t, xml.Unmarshal(b, &r))
	cases := map[string]string{}
	for _, s := range r.Suites {
		for i, c := range s.Cases {
			id := s.Package + "/" + strconv.Itoa(i+1) + ": " + c.Desc
			switch {
			case c.Failure != nil:
				cases[id] = *c.Failure
			case c.Error != nil:
				cases[id] = *c.Error
			default:
				cases[id] = ""
			}
		}
	}
	return cases
}

// serveLeanH2C serves conformanceHandler with the lean server (h2c, the
// given HPACK table size) on a loopback port until the test ends.
func serveLeanH2C(t *testing.T, headerTable uint32) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := &Server{Handler: http.HandlerFunc(conformanceHandler), HeaderTableSize: headerTable}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	t.Cleanup(func() {
		require.NoError(t, srv.Close())
		require.ErrorIs(t, <-done, ErrServerClosed)
	})
	return ln.Addr().String()
}

// serveStdH2C serves conformanceHandler with net/http's HTTP/2 server
// (h2c with prior knowledge, as the gateway's std server without TLS) on
// a loopback port until the test ends.
func serveStdH2C(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	protocols := new(http.Protocols)
	protocols.SetUnencryptedHTTP2(true)
	srv := &http.Server{Handler: http.HandlerFunc(conformanceHandler), Protocols: protocols, ReadHeaderTimeout: DefaultReadHeaderTimeout}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	t.Cleanup(func() {
		require.NoError(t, srv.Close())
		require.ErrorIs(t, <-done, http.ErrServerClosed)
		// net/http's HTTP/2 server keeps a connection's goroutine until its
		// GOAWAY or idle timers fire after the peer left; wait for them to
		// end, so goleak in TestMain sees none of the reference server's.
		require.Eventually(t, func() bool {
			buf := make([]byte, 4<<20)
			n := runtime.Stack(buf, true)
			return !bytes.Contains(buf[:n], []byte("http2serverConn).serve"))
		}, 30*time.Second, 50*time.Millisecond, "net/http's h2 connections end")
	})
	return ln.Addr().String()
}
