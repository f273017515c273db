package harness

import (
	"testing"
	"time"
)

func TestSummarizeNearestRank(t *testing.T) {
	var ds []time.Duration
	for i := 100; i >= 1; i-- {
		ds = append(ds, time.Duration(i)*time.Second)
	}
	d := Summarize(ds)
	if d.N != 100 || d.Min != 1 || d.P50 != 50 || d.P90 != 90 || d.P99 != 99 || d.Max != 100 || d.Mean != 50.5 {
		t.Fatalf("got %+v", d)
	}
	if got := Summarize(nil); got.N != 0 {
		t.Fatalf("empty: got %+v", got)
	}
	if got := Summarize([]time.Duration{3 * time.Second}); got.P50 != 3 || got.P99 != 3 {
		t.Fatalf("one: got %+v", got)
	}
}

func TestLineWriterSplitsAcrossWrites(t *testing.T) {
	var lines []string
	w := &lineWriter{fn: func(l string) { lines = append(lines, l) }}
	for _, p := range []string{"LEA", "DER 1\nSTAR", "TED\n", "partial"} {
		if _, err := w.Write([]byte(p)); err != nil {
			t.Fatal(err)
		}
	}
	if len(lines) != 2 || lines[0] != "LEADER 1" || lines[1] != "STARTED" {
		t.Fatalf("got %q", lines)
	}
}
