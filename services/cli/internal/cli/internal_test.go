package cli

import (
	"bytes"
	"errors"
	"strings"
	"testing"

	controlv1 "github.com/leasehold/leasehold/pkg/gen/leasehold/control/v1"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
)

// TestCheckRunCount: the values the api accepts pass, the others are
// usage errors naming the flag.
func TestCheckRunCount(t *testing.T) {
	for _, c := range []struct {
		s         string
		allowZero bool
		ok        bool
	}{
		{"1", false, true}, {"50", false, true}, {"25%", false, true}, {"100%", false, true}, {"100000", false, true},
		{"0", false, false}, {"0%", false, false}, {"101%", false, false}, {"100001", false, false},
		{"", false, false}, {"-1", false, false}, {"+1", false, false}, {"1.5", false, false}, {"ten", false, false},
		{"%", false, false}, {"5%%", false, false},
		{"0", true, true}, {"0%", true, true}, {"10%", true, true}, {"150%", true, false}, {"x", true, false},
	} {
		err := checkRunCount("--max-x", c.s, c.allowZero)
		if (err == nil) != c.ok {
			t.Errorf("checkRunCount(%q, allowZero %v) = %v, want ok %v", c.s, c.allowZero, err, c.ok)
			continue
		}
		var ue *usageError
		if err != nil && (!errors.As(err, &ue) || !strings.HasPrefix(err.Error(), "--max-x ")) {
			t.Errorf("checkRunCount(%q): %v is not a usage error naming the flag", c.s, err)
		}
	}
}

// TestPrefixSink: whole lines are prefixed, a partial line waits for its
// end or for done, and the streams stay apart.
func TestPrefixSink(t *testing.T) {
	var out, errOut bytes.Buffer
	p := newPrefixSink(&out, &errOut, true)
	p.write("n1", nodev1.OutputStream_OUTPUT_STREAM_STDOUT, []byte("a\nb"))
	p.write("n2", nodev1.OutputStream_OUTPUT_STREAM_STDOUT, []byte("x\n"))
	p.write("n1", nodev1.OutputStream_OUTPUT_STREAM_STDOUT, []byte("c\nd"))
	p.write("n1", nodev1.OutputStream_OUTPUT_STREAM_STDERR, []byte("e"))
	p.done("n1")
	if got, want := out.String(), "n1: a\nn2: x\nn1: bc\nn1: d\n"; got != want {
		t.Fatalf("stdout %q, want %q", got, want)
	}
	if got, want := errOut.String(), "n1: e\n"; got != want {
		t.Fatalf("stderr %q, want %q", got, want)
	}
}

// TestCountsLine lists the non-zero counts in the order of the states.
func TestCountsLine(t *testing.T) {
	r := &controlv1.Run{Total: 3, Counts: map[string]int32{"not_started": 2, "failed": 1, "succeeded": 0}}
	if got, want := countsLine(r), "3 node(s): 1 failed, 2 not_started"; got != want {
		t.Fatalf("%q, want %q", got, want)
	}
}
