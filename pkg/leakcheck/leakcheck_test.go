package leakcheck_test

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/leasehold/leasehold/pkg/leakcheck"
	"github.com/leasehold/leasehold/pkg/proctest"
)

// envLeak makes TestLeaksAGoroutine leak, in the child binary that
// TestMainFailsABinaryThatLeaks starts; envBuild makes TestBuildsABinary
// build one, in the child of TestMainRemovesWhatTheTestsBuilt.
const (
	envLeak  = "LEASEHOLD_LEAKCHECK_LEAK"
	envBuild = "LEASEHOLD_LEAKCHECK_BUILD"
)

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
	if os.Getenv(envLeak) != "" || os.Getenv(envBuild) != "" {
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

func TestBuildsABinary(t *testing.T) {
	if os.Getenv(envBuild) == "" {
		t.Skip("builds only in the child binary of TestMainRemovesWhatTheTestsBuilt")
	}
	fmt.Println("built:", proctest.Build(t, "testdata/hello"))
}

// TestMainRemovesWhatTheTestsBuilt runs this binary again with a test that
// builds a program with proctest.Build: once the binary has exited, the
// program is gone.
func TestMainRemovesWhatTheTestsBuilt(t *testing.T) {
	if os.Getenv(envLeak) != "" || os.Getenv(envBuild) != "" {
		t.Skip("not in a child")
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestBuildsABinary$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), envBuild+"=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("the child failed: %v\n%s", err, out)
	}
	_, after, ok := strings.Cut(string(out), "built: ")
	if !ok {
		t.Fatalf("the child built nothing:\n%s", out)
	}
	path, _, _ := strings.Cut(after, "\n")
	if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("%s is still there after the child exited (stat: %v)", path, err)
	}
	if _, err := os.Stat(filepath.Dir(path)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("%s is still there after the child exited (stat: %v)", filepath.Dir(path), err)
	}
}
