package leakcheck_test

import (
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/leasehold/leasehold/pkg/leakcheck"
)

// envLeak makes TestLeaksAGoroutine leak, in the child binary that
// TestMainFailsABinaryThatLeaks starts.
const envLeak = "LEASEHOLD_LEAKCHECK_LEAK"

func TestMain(m *testing.M) { leakcheck.Main(m) }

func TestLeaksAGoroutine(t *testing.T) {
	if os.Getenv(envLeak) == "" {
		t.Skip("leaks only in the child binary of TestMainFailsABinaryThatLeaks")
	}
	block := make(chan struct{})
	go func() { <-block }() // never closed
}

// TestMainFailsABinaryThatLeaks runs this binary again with a test that
// passes but leaves a goroutine behind: Main must fail the binary and name
// the goroutine.
func TestMainFailsABinaryThatLeaks(t *testing.T) {
	if os.Getenv(envLeak) != "" {
		t.Skip("the child runs only the leaking test")
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestLeaksAGoroutine$", "-test.count=1")
	cmd.Env = append(os.Environ(), envLeak+"=1")
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() == 0 {
		t.Fatalf("the leaking binary did not fail (err %v):\n%s", err, out)
	}
	for _, want := range []string{"found unexpected goroutines", "TestLeaksAGoroutine.func1"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("the child's output lacks %q:\n%s", want, out)
		}
	}
}
