package daemon

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jonboulle/clockwork"
	"github.com/stretchr/testify/require"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
)

func result(id string, output []byte) *nodev1.CommandResult {
	return &nodev1.CommandResult{CommandId: id, ResultId: id + "/1", Output: output}
}

func fileSize(t testing.TB, path string) int64 {
	t.Helper()
	fi, err := os.Stat(path)
	require.NoError(t, err)
	return fi.Size()
}

// TestFileJournalGrowthIsBounded: 100,000 records (50,000 commands started
// and finished, from 16 goroutines, so fsyncs are shared) through a small
// window; the file never grows past the compaction threshold plus a line
// per writer, and what is kept is exactly the window.
func TestFileJournalGrowthIsBounded(t *testing.T) {
	t.Parallel()
	records := 100_000
	if testing.Short() {
		records = 8_000 // every fsync is real
	}
	opts := JournalOptions{KeepResults: 8, KeepIDs: 32, MinCompactBytes: 16 << 10}
	path := filepath.Join(t.TempDir(), "journal")
	j, err := OpenFileJournalWith(path, opts)
	require.NoError(t, err)
	defer j.Close()
	// A started line is ~25 bytes, a result ~120: past MinCompactBytes a
	// compaction leaves 32 lines (~2.5 KiB), under half of it, so the
	// threshold stays MinCompactBytes; appends racing a compaction add at
	// most a line per writer.
	const writers = 16
	bound := opts.MinCompactBytes + writers*256
	var largest atomic.Int64
	var wg sync.WaitGroup
	for w := range writers {
		wg.Go(func() {
			for i := w; i < records/2; i += writers {
				id := fmt.Sprintf("cmd-%06d", i)
				if err := j.Record(id, nil); err != nil {
					t.Error(err)
					return
				}
				if err := j.Record(id, result(id, []byte("ok"))); err != nil {
					t.Error(err)
					return
				}
				if i%50 == w {
					fi, err := os.Stat(path)
					if err != nil {
						t.Error(err)
						return
					}
					for {
						old := largest.Load()
						if fi.Size() <= old || largest.CompareAndSwap(old, fi.Size()) {
							break
						}
					}
				}
			}
		})
	}
	wg.Wait()
	require.LessOrEqual(t, largest.Load(), bound)
	// A last, sequential run decides which commands are the most recent.
	for i := range 40 {
		id := fmt.Sprintf("last-%02d", i)
		require.NoError(t, j.Record(id, nil))
		require.NoError(t, j.Record(id, result(id, []byte("ok"))))
		largest.Store(max(largest.Load(), fileSize(t, path)))
	}
	require.LessOrEqual(t, largest.Load(), bound)
	st := j.Stats()
	require.Equal(t, fileSize(t, path), st.Bytes)
	require.Equal(t, 8, st.Results)
	require.Equal(t, 24, st.Forgotten)
	require.Zero(t, st.InFlight)
	require.NoError(t, st.CompactErr)
	require.Greater(t, st.Compactions, int64(1))
	require.Less(t, st.Syncs, int64(records), "concurrent Records share fsyncs")
	t.Logf("%d records: largest file %d bytes (bound %d), %d compactions, %d fsyncs, now %d bytes",
		records+80, largest.Load(), bound, st.Compactions, st.Syncs, st.Bytes)

	r, executed := j.Seen("last-39")
	require.True(t, executed)
	require.Equal(t, []byte("ok"), r.GetOutput())
	r, executed = j.Seen("last-29") // past the results, within the ids
	require.True(t, executed)
	require.Equal(t, "last-29/forgotten", r.GetResultId())
	_, executed = j.Seen("last-00") // past both
	require.False(t, executed)
	_, executed = j.Seen("cmd-000000")
	require.False(t, executed)
}

// TestFileJournalKeepsInFlightAndWindowAcrossCompactionAndReopen: commands
// started long ago and never finished survive any number of compactions
// and a reopen; the most recent results come back with their bytes, older
// ones as forgotten (never as unknown, which would run them again).
func TestFileJournalKeepsInFlightAndWindowAcrossCompactionAndReopen(t *testing.T) {
	t.Parallel()
	opts := JournalOptions{KeepResults: 4, KeepIDs: 10, MinCompactBytes: 2 << 10}
	path := filepath.Join(t.TempDir(), "journal")
	j, err := OpenFileJournalWith(path, opts)
	require.NoError(t, err)
	for _, id := range []string{"running-a", "running-b", "running-c"} {
		require.NoError(t, j.Record(id, nil))
	}
	for i := range 200 {
		id := fmt.Sprintf("done-%03d", i)
		require.NoError(t, j.Record(id, nil))
		require.NoError(t, j.Record(id, result(id, []byte{0, 0xff, byte(i)})))
	}
	require.Greater(t, j.Stats().Compactions, int64(3))
	want := j.Stats()
	require.NoError(t, j.Close())
	require.Error(t, j.Record("late", nil), "a closed journal refuses records")

	j, err = OpenFileJournalWith(path, opts)
	require.NoError(t, err)
	defer j.Close()
	got := j.Stats()
	require.Equal(t, want.InFlight, got.InFlight)
	require.Equal(t, want.Results, got.Results)
	require.Equal(t, want.Forgotten, got.Forgotten)
	require.Equal(t, []string{"running-a", "running-b", "running-c"}, j.InFlight())
	r, executed := j.Seen("running-b")
	require.True(t, executed)
	require.Nil(t, r)
	for i := 196; i < 200; i++ {
		r, executed := j.Seen(fmt.Sprintf("done-%03d", i))
		require.True(t, executed)
		require.Equal(t, []byte{0, 0xff, byte(i)}, r.GetOutput(), "result %d within the window", i)
	}
	for i := 190; i < 196; i++ {
		r, executed := j.Seen(fmt.Sprintf("done-%03d", i))
		require.True(t, executed)
		require.Equal(t, fmt.Sprintf("done-%03d/forgotten", i), r.GetResultId())
	}
	_, executed = j.Seen("done-189")
	require.False(t, executed)

	// Finishing an in-flight command after the reopen keeps the order: it
	// is now the most recent result.
	require.NoError(t, j.Record("running-a", result("running-a", []byte("late"))))
	r, _ = j.Seen("running-a")
	require.Equal(t, []byte("late"), r.GetOutput())
	r, _ = j.Seen("done-196")
	require.Equal(t, "done-196/forgotten", r.GetResultId())
}

// TestFileJournalResultBytesBound: large results are dropped past
// KeepResultBytes, oldest first, but the most recent is always kept.
func TestFileJournalResultBytesBound(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "journal")
	j, err := OpenFileJournalWith(path, JournalOptions{KeepResults: 100, KeepResultBytes: 64 << 10, MinCompactBytes: 1})
	require.NoError(t, err)
	defer j.Close()
	big := make([]byte, 20<<10) // ~27 KiB in base64
	for i := range 5 {
		require.NoError(t, j.Record(fmt.Sprint(i), result(fmt.Sprint(i), big)))
	}
	st := j.Stats()
	require.Equal(t, 2, st.Results)
	require.Equal(t, 3, st.Forgotten)
	require.Less(t, fileSize(t, path), int64(128<<10))
	huge := make([]byte, 100<<10)
	require.NoError(t, j.Record("huge", result("huge", huge)))
	r, _ := j.Seen("huge")
	require.Len(t, r.GetOutput(), len(huge), "the most recent result is kept whatever its size")
	require.Equal(t, 1, j.Stats().Results)
}

// TestFileJournalReopenAfterCrash: what a crash can leave, a temporary
// file of an unfinished compaction and a torn last line, is ignored at
// open, and appends after it start on a line of their own.
func TestFileJournalReopenAfterCrash(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	path := filepath.Join(dir, "journal")
	j, err := OpenFileJournal(path)
	require.NoError(t, err)
	require.NoError(t, j.Record("running", nil))
	require.NoError(t, j.Record("done", result("done", []byte("out"))))
	require.NoError(t, j.Close())

	// A compaction that crashed before its rename: the temporary file may
	// hold anything (here: a command the journal never had).
	require.NoError(t, os.WriteFile(path+".compact.tmp", []byte(`{"c":"ghost","r":{"commandId":"ghost"}}`+"\n"+`{"c":"half`), 0o600))
	// An append that crashed mid-line.
	fh, err := os.OpenFile(path, os.O_APPEND|os.O_WRONLY, 0)
	require.NoError(t, err)
	_, err = fh.WriteString(`{"c":"torn","r":{"comm`)
	require.NoError(t, err)
	require.NoError(t, fh.Close())

	j, err = OpenFileJournal(path)
	require.NoError(t, err)
	require.NoFileExists(t, path+".compact.tmp")
	_, executed := j.Seen("ghost")
	require.False(t, executed)
	_, executed = j.Seen("torn")
	require.False(t, executed)
	require.Equal(t, []string{"running"}, j.InFlight())
	require.NoError(t, j.Record("after", result("after", []byte("x"))))
	require.NoError(t, j.Close())

	b, err := os.ReadFile(path)
	require.NoError(t, err)
	require.NotContains(t, string(b), "torn")
	require.True(t, strings.HasSuffix(string(b), "\n"))

	j, err = OpenFileJournal(path)
	require.NoError(t, err)
	defer j.Close()
	r, _ := j.Seen("after")
	require.Equal(t, []byte("x"), r.GetOutput(), "the append after a torn line is intact")
	r, _ = j.Seen("done")
	require.Equal(t, []byte("out"), r.GetOutput())
	require.Equal(t, []string{"running"}, j.InFlight())
}

// TestFileJournalFirstResultIsFinal: a second start or result of a
// finished command changes nothing, before and after a reopen.
func TestFileJournalFirstResultIsFinal(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "journal")
	j, err := OpenFileJournal(path)
	require.NoError(t, err)
	require.NoError(t, j.Record("c", nil))
	require.NoError(t, j.Record("c", result("c", []byte("first"))))
	require.NoError(t, j.Record("c", nil))
	require.NoError(t, j.Record("c", result("c", []byte("second"))))
	r, _ := j.Seen("c")
	require.Equal(t, []byte("first"), r.GetOutput())
	require.Empty(t, j.InFlight())
	require.NoError(t, j.Close())
	j, err = OpenFileJournal(path)
	require.NoError(t, err)
	defer j.Close()
	r, _ = j.Seen("c")
	require.Equal(t, []byte("first"), r.GetOutput())
	require.Empty(t, j.InFlight())
}

// TestFileJournalConcurrentRecord: Record from many goroutines while
// compactions run (meant for -race); every command ends finished and the
// counts survive a reopen.
func TestFileJournalConcurrentRecord(t *testing.T) {
	t.Parallel()
	opts := JournalOptions{KeepResults: 16, KeepIDs: 64, MinCompactBytes: 4 << 10}
	path := filepath.Join(t.TempDir(), "journal")
	j, err := OpenFileJournalWith(path, opts)
	require.NoError(t, err)
	const writers, each = 8, 40
	var wg sync.WaitGroup
	for w := range writers {
		wg.Go(func() {
			for i := range each {
				id := fmt.Sprintf("w%d-%d", w, i)
				if err := j.Record(id, nil); err != nil {
					t.Error(err)
					return
				}
				_, executed := j.Seen(id)
				if !executed {
					t.Errorf("%s not seen after its start", id)
				}
				_ = j.InFlight()
				if err := j.Record(id, result(id, []byte(id))); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	st := j.Stats()
	require.Equal(t, 16, st.Results)
	require.Equal(t, 48, st.Forgotten)
	require.Zero(t, st.InFlight)
	require.Positive(t, st.Compactions)
	require.NoError(t, j.Close())
	j, err = OpenFileJournalWith(path, opts)
	require.NoError(t, err)
	defer j.Close()
	got := j.Stats()
	require.Equal(t, st.Results, got.Results)
	require.Equal(t, st.Forgotten, got.Forgotten)
	require.Empty(t, j.InFlight())
}

// TestFileJournalForgottenCommandIsNotRerun: a replay of a command whose
// result the journal no longer keeps is answered with the forgotten
// result, never run.
func TestFileJournalForgottenCommandIsNotRerun(t *testing.T) {
	t.Parallel()
	j, err := OpenFileJournalWith(filepath.Join(t.TempDir(), "journal"), JournalOptions{KeepResults: 1, KeepIDs: 10})
	require.NoError(t, err)
	defer j.Close()
	require.NoError(t, j.Record("old", nil))
	require.NoError(t, j.Record("old", result("old", nil)))
	require.NoError(t, j.Record("new", result("new", nil)))
	d := &Daemon{cfg: Config{Journal: j, Handler: func(context.Context, *nodev1.Command) Outcome {
		t.Error("a forgotten command must not run again")
		return Outcome{}
	}}, clock: clockwork.NewRealClock(), running: map[string]*execution{}, stopped: map[string]bool{}, log: discardLogger()}
	d.handleCommand(context.Background(), &nodev1.Command{CommandId: "old", DispatchCount: 2})
	require.EqualValues(t, 1, d.Stats().Replays)
	require.Zero(t, d.Stats().Executions)
}

// TestResultErrorIsSanitized: a Handler's error with NUL and invalid UTF-8
// bytes still gives a result that is journalled (and survives a reopen)
// and sent; the output's raw bytes go through untouched.
func TestResultErrorIsSanitized(t *testing.T) {
	t.Parallel()
	results := make(chan *nodev1.CommandResult, 1)
	f := &fakeGateway{script: func(n int64, ctx context.Context, s *stream) error {
		if err := welcome(s); err != nil {
			return err
		}
		_ = s.Send(&nodev1.ConnectResponse{Msg: &nodev1.ConnectResponse_Command{Command: &nodev1.Command{CommandId: "bad", Kind: "exec", DispatchCount: 1}}})
		for {
			m, err := s.Receive()
			if err != nil {
				return nil
			}
			if r := m.GetCommandResult(); r != nil {
				results <- r
			}
		}
	}}
	addr := startFake(t, f)
	path := filepath.Join(t.TempDir(), "journal")
	j, err := OpenFileJournal(path)
	require.NoError(t, err)
	output := []byte("a\x00b\xffc")
	d, err := New(Config{Address: addr, NodeID: "n1", Credential: "c", Journal: j,
		Handler: func(context.Context, *nodev1.Command) Outcome {
			return Outcome{ExitCode: 1, Output: output, Err: "nul\x00 and \xff\xfe bytes"}
		}})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = d.Run(ctx) }()
	var r *nodev1.CommandResult
	select {
	case r = <-results:
	case <-time.After(10 * time.Second):
		t.Fatal("no result sent")
	}
	cancel()
	<-done
	const want = "nul\uFFFD and \uFFFD bytes" // a run of invalid bytes is one U+FFFD
	require.Equal(t, want, r.GetError())
	require.Equal(t, output, r.GetOutput())
	require.NoError(t, j.Close())

	j, err = OpenFileJournal(path)
	require.NoError(t, err)
	defer j.Close()
	jr, executed := j.Seen("bad")
	require.True(t, executed)
	require.Equal(t, want, jr.GetError())
	require.Equal(t, output, jr.GetOutput())
}

func TestSanitizeText(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"":                  "",
		"plain":             "plain",
		"ünïcödé ✓":         "ünïcödé ✓",
		"a\x00b":            "a\uFFFDb",
		"\xff":              "\uFFFD",
		"x\xc3":             "x\uFFFD", // a truncated two-byte sequence
		"\x00\xed\xa0\x80y": "\uFFFD\uFFFDy",
	} {
		require.Equal(t, want, sanitizeText(in), "%q", in)
	}
}

// BenchmarkFileJournalRecord: one Record (a start or a result, in turn)
// with the default options, each fsynced; reports the file's size at the
// end.
func BenchmarkFileJournalRecord(b *testing.B) {
	path := filepath.Join(b.TempDir(), "journal")
	j, err := OpenFileJournal(path)
	require.NoError(b, err)
	defer j.Close()
	out := []byte(strings.Repeat("output line\n", 20))
	i := 0
	for b.Loop() {
		id := fmt.Sprintf("cmd-%08d", i/2)
		var r *nodev1.CommandResult
		if i%2 == 1 {
			r = result(id, out)
		}
		if err := j.Record(id, r); err != nil {
			b.Fatal(err)
		}
		i++
	}
	st := j.Stats()
	b.ReportMetric(float64(st.Bytes), "file-bytes")
	b.ReportMetric(float64(st.Compactions), "compactions")
}

// BenchmarkFileJournalRecordParallel: Records from GOMAXPROCS×8
// goroutines, which share fsyncs; reports fsyncs per Record.
func BenchmarkFileJournalRecordParallel(b *testing.B) {
	path := filepath.Join(b.TempDir(), "journal")
	j, err := OpenFileJournal(path)
	require.NoError(b, err)
	defer j.Close()
	out := []byte(strings.Repeat("output line\n", 20))
	var n atomic.Int64
	b.SetParallelism(8)
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			id := fmt.Sprintf("cmd-%08d", n.Add(1))
			if err := j.Record(id, result(id, out)); err != nil {
				b.Error(err)
				return
			}
		}
	})
	st := j.Stats()
	b.ReportMetric(float64(st.Bytes), "file-bytes")
	b.ReportMetric(float64(st.Syncs)/float64(n.Load()), "fsyncs/record")
}
