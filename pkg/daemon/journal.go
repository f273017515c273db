package daemon

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"syscall"
	"time"

	"github.com/jonboulle/clockwork"
	"google.golang.org/protobuf/encoding/protojson"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
)

// Journal remembers which commands this node has started and how they
// ended, so a replayed command executes at most once: the daemon records a
// command as started before executing it, and records its result after.
// A replay of a command with a result re-sends that result; a replay of one
// started but never finished (the daemon died while it ran) is reported as
// interrupted, never run again.
type Journal interface {
	// Seen reports the stored result of commandID, if any, and whether it
	// was ever started.
	Seen(commandID string) (result *nodev1.CommandResult, executed bool)
	// Record stores commandID as started (result nil) or finished. It is
	// durable when it returns.
	Record(commandID string, result *nodev1.CommandResult) error
	// InFlight lists commands started without a result, for Hello.
	InFlight() []string
}

type entry struct {
	result   *nodev1.CommandResult
	executed bool
}

// MemoryJournal is a Journal kept in memory: at most once per process.
type MemoryJournal struct {
	mu sync.Mutex
	m  map[string]entry
}

// NewMemoryJournal returns an empty in-memory journal.
func NewMemoryJournal() *MemoryJournal { return &MemoryJournal{m: map[string]entry{}} }

// Seen implements Journal.
func (j *MemoryJournal) Seen(id string) (*nodev1.CommandResult, bool) {
	j.mu.Lock()
	defer j.mu.Unlock()
	e := j.m[id]
	return e.result, e.executed
}

// Record implements Journal.
func (j *MemoryJournal) Record(id string, r *nodev1.CommandResult) error {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.m[id] = entry{result: r, executed: true}
	return nil
}

// InFlight implements Journal.
func (j *MemoryJournal) InFlight() []string {
	j.mu.Lock()
	defer j.mu.Unlock()
	var out []string
	for id, e := range j.m {
		if e.executed && e.result == nil {
			out = append(out, id)
		}
	}
	sort.Strings(out)
	return out
}

// What a FileJournal keeps (docs/node.md, "Install", State).
//
// The gateway sends a node a command again (on Hello, or after the
// sweeper's ack timeout puts it back to pending) only while the command has
// no stored result: a stored result makes the command terminal, and
// terminal commands are never dispatched again. So a finished command's
// result is needed only until the gateway has stored it, and there are few
// such commands at any time: a session holds at most --gateway.node-window
// commands unanswered (32 by default, at most 512), and the gateway reads at
// most about as many results ahead of its group commit (the session's
// report budget); a result that fails to commit closes the session and its
// command is replayed. Other commands reach the node only through that
// window, so between a command's result and its storing, at most about
// twice the window (1,024 at the largest window) other commands can finish.
// DefaultKeepResults covers that. The bound is counted in commands, never
// in time: a node may be cut off for days with a finished command whose
// result the gateway has not stored, and nothing else finishes meanwhile,
// so a time retention would forget exactly the result still owed.
//
// Results can be large (their output), so KeepResultBytes bounds them too,
// and a result pushed out by it (or by a gateway configured past these
// bounds) is not a second run: the ids of DefaultKeepIDs finished commands
// are kept without their results, and a replay of one of those is answered
// with a result that says so (forgottenResult) instead of running it.
const (
	// DefaultKeepResults is how many of the most recently finished
	// commands keep their results.
	DefaultKeepResults = 1024
	// DefaultKeepResultBytes bounds the encoded size of those results.
	DefaultKeepResultBytes = 32 << 20
	// DefaultKeepIDs is how many of the most recently finished commands
	// are remembered at all (with or without their results).
	DefaultKeepIDs = 16384
	// DefaultMinCompactBytes is the smallest file that is compacted.
	DefaultMinCompactBytes = 1 << 20
)

// JournalOptions bounds what a FileJournal keeps. Commands started and not
// finished are always kept, whatever these say. Zero values take the
// defaults.
type JournalOptions struct {
	// KeepResults is how many of the most recently finished commands keep
	// their results (DefaultKeepResults).
	KeepResults int
	// KeepResultBytes bounds the encoded size of the kept results; the most
	// recent result is kept whatever its size (DefaultKeepResultBytes).
	KeepResultBytes int64
	// KeepIDs is how many of the most recently finished commands are
	// remembered, results or not; at least KeepResults (DefaultKeepIDs).
	KeepIDs int
	// MinCompactBytes: the file is compacted when it has grown past twice
	// its size after the last compaction and past this
	// (DefaultMinCompactBytes).
	MinCompactBytes int64
}

func (o JournalOptions) withDefaults() JournalOptions {
	if o.KeepResults <= 0 {
		o.KeepResults = DefaultKeepResults
	}
	if o.KeepResultBytes <= 0 {
		o.KeepResultBytes = DefaultKeepResultBytes
	}
	if o.KeepIDs <= 0 {
		o.KeepIDs = DefaultKeepIDs
	}
	o.KeepIDs = max(o.KeepIDs, o.KeepResults)
	if o.MinCompactBytes <= 0 {
		o.MinCompactBytes = DefaultMinCompactBytes
	}
	return o
}

// FileJournal is a Journal in a file of JSON lines, each fsynced before
// Record returns, and loaded in full at open. A torn last line (a crash
// mid-write) is ignored.
//
// The file stays small: it is rewritten with only what JournalOptions
// keeps (every command in flight, the most recent results and ids) at open
// and whenever it has grown past twice its size after the last rewrite, so
// the cost of rewriting is spread over as many appends as it keeps. A
// rewrite goes to a temporary file in the same directory, fsynced, renamed
// over the journal and followed by an fsync of the directory, so a crash at
// any point leaves the old file or the new one, each complete.
type FileJournal struct {
	path, tmp string
	opts      JournalOptions
	lock      *os.File // <path>.lock, flocked for the journal's life

	mu     sync.Mutex
	f      *os.File
	closed bool
	m      map[string]*fileEntry
	// order holds the finished commands, oldest first: order[:withResult]
	// are remembered without results, order[withResult:] with them.
	order       []string
	withResult  int
	resultBytes int64
	inFlight    int
	size        int64 // of the file
	// appended counts the bytes ever appended, durable those of them known
	// to be on disk; syncing says an fsync is running (without mu) and
	// synced is signalled when it ends.
	appended, durable int64
	syncing           bool
	synced            *sync.Cond
	syncs             int64
	compactAt         int64 // size past which Record compacts
	compactions       int64
	compactErr        error
}

// fileEntry is a command the FileJournal knows: line is the encoded result
// (nil while in flight and once forgotten).
type fileEntry struct {
	line     []byte
	finished bool
}

// fileLine is one line of the file: a command started (c alone), finished
// with its result (c and r), or finished with its result forgotten (c and
// f, written by compaction only).
type fileLine struct {
	Command   string          `json:"c"`
	Result    json.RawMessage `json:"r,omitempty"`
	Forgotten bool            `json:"f,omitempty"`
}

// JournalStats describes a FileJournal's contents.
type JournalStats struct {
	// Bytes is the file's size; InFlight, Results and Forgotten count the
	// commands started and not finished, finished with their result, and
	// finished with only their id kept.
	Bytes                        int64
	InFlight, Results, Forgotten int
	// Compactions counts rewrites since open (the one at open included);
	// CompactErr is the last rewrite's error, nil once one succeeds.
	Compactions int64
	CompactErr  error
	// Syncs counts the fsyncs of appended lines since open: fewer than
	// the Records when concurrent ones shared them.
	Syncs int64
}

// OpenFileJournal opens (creating it if needed) the journal at path with
// the default JournalOptions.
func OpenFileJournal(path string) (*FileJournal, error) {
	return OpenFileJournalWith(path, JournalOptions{})
}

// ErrJournalLocked is returned (wrapped) by OpenFileJournal when another
// open journal, in this process or another, holds the file.
var ErrJournalLocked = errors.New("journal in use by another process")

// OpenFileJournalWith opens (creating it if needed) the journal at path,
// keeping what opts says, and compacts it: a leftover temporary file of an
// interrupted compaction is removed and a torn last line dropped, so the
// next append starts on a line of its own. It holds an exclusive flock on
// <path>.lock until Close: a second agent given the same file is refused
// (ErrJournalLocked) instead of interleaving its records with the first's.
// The kernel drops the lock with the process, so a killed agent leaves
// nothing to clean up.
func OpenFileJournalWith(path string, opts JournalOptions) (_ *FileJournal, err error) {
	j := &FileJournal{path: path, tmp: path + ".compact.tmp", opts: opts.withDefaults(), m: map[string]*fileEntry{}}
	j.synced = sync.NewCond(&j.mu)
	if j.lock, err = lockFile(path + ".lock"); err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			_ = j.lock.Close()
		}
	}()
	// A temporary file is never the journal: the rename, which is what
	// makes it one, did not happen.
	if err := os.Remove(j.tmp); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("remove the journal's leftover %s: %w", j.tmp, err)
	}
	if err := j.load(); err != nil {
		return nil, err
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	if err := j.compactLocked(); err != nil {
		return nil, err
	}
	return j, nil
}

func (j *FileJournal) load() error {
	f, err := os.Open(j.path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("open journal: %w", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 64<<20)
	for sc.Scan() {
		var l fileLine
		if err := json.Unmarshal(sc.Bytes(), &l); err != nil || l.Command == "" {
			continue // a torn write
		}
		if len(l.Result) > 0 {
			if err := protojson.Unmarshal(l.Result, &nodev1.CommandResult{}); err != nil {
				continue
			}
		}
		j.applyLocked(l.Command, l.Result, l.Forgotten)
	}
	if err := sc.Err(); err != nil {
		return fmt.Errorf("read journal %s: %w", j.path, err)
	}
	return nil
}

// applyLocked adds a record to the in-memory state. A result, or the
// knowledge that there was one, is final: a later start or result for the
// same command changes nothing.
func (j *FileJournal) applyLocked(id string, result []byte, forgotten bool) {
	e := j.m[id]
	if e != nil && e.finished {
		return
	}
	if e == nil {
		e = &fileEntry{}
		j.m[id] = e
	} else {
		j.inFlight-- // it was started
	}
	if len(result) == 0 && !forgotten {
		j.inFlight++
		return
	}
	e.finished = true
	if forgotten {
		// Forgotten ids come first in a compacted file, so they go before
		// every result in order.
		j.order = append(j.order, id)
		if j.withResult < len(j.order)-1 {
			copy(j.order[j.withResult+1:], j.order[j.withResult:len(j.order)-1])
			j.order[j.withResult] = id
		}
		j.withResult++
	} else {
		e.line = result
		j.order = append(j.order, id)
		j.resultBytes += int64(len(result))
	}
	j.evictLocked()
}

// evictLocked drops the oldest results past KeepResults or KeepResultBytes
// (keeping their ids), then the oldest ids past KeepIDs.
func (j *FileJournal) evictLocked() {
	for n := len(j.order) - j.withResult; n > 1 && (n > j.opts.KeepResults || j.resultBytes > j.opts.KeepResultBytes); n-- {
		e := j.m[j.order[j.withResult]]
		j.resultBytes -= int64(len(e.line))
		e.line = nil
		j.withResult++
	}
	for len(j.order) > j.opts.KeepIDs {
		id := j.order[0]
		if j.withResult > 0 {
			j.withResult--
		} else {
			j.resultBytes -= int64(len(j.m[id].line))
		}
		delete(j.m, id)
		j.order[0] = ""
		j.order = j.order[1:]
	}
}

// forgottenResult is what a replay of a command whose result was dropped
// gets: it says the command ran and is not run again. Its result id is
// its own, so the control plane stores it beside, not over, a result it
// may have stored already.
func forgottenResult(id string) *nodev1.CommandResult {
	return &nodev1.CommandResult{CommandId: id, ResultId: id + "/forgotten", ExitCode: -1,
		Error: "this command already ran on this node; its result is no longer kept by the node's journal, and it is not run again"}
}

// Seen implements Journal. A finished command whose result is no longer
// kept (JournalOptions) reports forgottenResult, so it is not run again.
func (j *FileJournal) Seen(id string) (*nodev1.CommandResult, bool) {
	j.mu.Lock()
	e := j.m[id]
	var line []byte
	var finished bool
	if e != nil {
		line, finished = e.line, e.finished
	}
	j.mu.Unlock()
	switch {
	case e == nil:
		return nil, false
	case !finished:
		return nil, true
	case line == nil:
		return forgottenResult(id), true
	}
	r := &nodev1.CommandResult{}
	if err := protojson.Unmarshal(line, r); err != nil {
		// Every line was parsed before it was kept; this cannot fail.
		return forgottenResult(id), true
	}
	return r, true
}

// Record implements Journal: it appends a line, compacts the file if it
// has doubled since the last compaction, and returns once the line is on
// disk (concurrent Records share their fsyncs). A command already
// finished stays as it is (its first result is final). A failed compaction
// does not fail the Record, which is durable by then; it is retried when
// the file has doubled again, and reported by Stats.
func (j *FileJournal) Record(id string, r *nodev1.CommandResult) error {
	if id == "" {
		return errors.New("journal: empty command id")
	}
	l := fileLine{Command: id}
	if r != nil {
		b, err := protojson.Marshal(r)
		if err != nil {
			return fmt.Errorf("journal the result of %s: %w", id, err)
		}
		l.Result = b
	}
	b, err := json.Marshal(l)
	if err != nil {
		return fmt.Errorf("journal %s: %w", id, err)
	}
	b = append(b, '\n')
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.closed {
		return errors.New("journal is closed")
	}
	if e := j.m[id]; e != nil && e.finished {
		// Its result may have been appended by a Record still waiting
		// for its fsync: this one is durable when that one is.
		return j.waitDurableLocked(j.appended)
	}
	if j.f == nil {
		// A compaction renamed the file but could not reopen it.
		if err := j.reopenLocked(); err != nil {
			return fmt.Errorf("journal %s: %w", id, err)
		}
	}
	if _, err := j.f.Write(b); err != nil {
		// Cut a partial line off, so the next append starts a line of its
		// own; if even that fails, the torn line is dropped at the next open.
		_ = j.f.Truncate(j.size)
		return fmt.Errorf("journal %s: %w", id, err)
	}
	j.size += int64(len(b))
	j.appended += int64(len(b))
	lsn := j.appended
	j.applyLocked(id, l.Result, false)
	if j.size > j.compactAt {
		if err := j.compactLocked(); err != nil {
			j.compactAt = 2 * j.size
		}
	}
	if err := j.waitDurableLocked(lsn); err != nil {
		return fmt.Errorf("journal %s: %w", id, err)
	}
	return nil
}

// waitDurableLocked returns once the first lsn bytes ever appended are on
// disk. One fsync covers every line appended before it: the Record that
// finds no fsync running starts one (without the lock, so others append
// meanwhile) and the others wait for it, then for the next if theirs came
// after it started. A compaction makes everything durable at once.
func (j *FileJournal) waitDurableLocked(lsn int64) error {
	for j.durable < lsn {
		if j.syncing {
			j.synced.Wait()
			continue
		}
		if j.f == nil {
			return errors.New("the journal file is not open (closed, or a compaction failed after its rename)")
		}
		f, target := j.f, j.appended
		j.syncing = true
		j.mu.Unlock()
		err := f.Sync()
		j.mu.Lock()
		j.syncing = false
		j.synced.Broadcast()
		if err == nil {
			j.syncs++
			j.durable = max(j.durable, target)
			continue
		}
		if j.durable >= lsn {
			return nil // a compaction meanwhile (which closed f) made it durable
		}
		return fmt.Errorf("fsync: %w", err)
	}
	return nil
}

// compactLocked rewrites the file with what is kept: forgotten ids, then
// results, oldest first (so a reload rebuilds the same order), then the
// commands in flight.
func (j *FileJournal) compactLocked() error {
	var buf bytes.Buffer
	line := func(l fileLine) error {
		b, err := json.Marshal(l)
		if err != nil {
			return fmt.Errorf("compact journal: %w", err)
		}
		buf.Write(b)
		buf.WriteByte('\n')
		return nil
	}
	for i, id := range j.order {
		l := fileLine{Command: id, Forgotten: i < j.withResult}
		if !l.Forgotten {
			l.Result = j.m[id].line
		}
		if err := line(l); err != nil {
			return err
		}
	}
	var running []string
	for id, e := range j.m {
		if !e.finished {
			running = append(running, id)
		}
	}
	sort.Strings(running)
	for _, id := range running {
		if err := line(fileLine{Command: id}); err != nil {
			return err
		}
	}
	err := j.replaceLocked(buf.Bytes())
	j.compactErr = err
	if err != nil {
		return err
	}
	j.compactions++
	j.durable = j.appended
	j.compactAt = max(2*j.size, j.opts.MinCompactBytes)
	return nil
}

// replaceLocked makes content the journal: temporary file, fsync, rename,
// fsync of the directory, then the new file reopened for appending.
func (j *FileJournal) replaceLocked(content []byte) error {
	t, err := os.OpenFile(j.tmp, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return fmt.Errorf("compact journal: %w", err)
	}
	_, err = t.Write(content)
	if err == nil {
		err = t.Sync()
	}
	if cerr := t.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		_ = os.Remove(j.tmp)
		return fmt.Errorf("compact journal: write %s: %w", j.tmp, err)
	}
	if err := os.Rename(j.tmp, j.path); err != nil {
		_ = os.Remove(j.tmp)
		return fmt.Errorf("compact journal: %w", err)
	}
	j.size = int64(len(content))
	// From here the new file is the journal for whoever opens the path;
	// the old descriptor must not be appended to any more.
	if j.f != nil {
		_ = j.f.Close()
		j.f = nil
	}
	if err := syncDir(filepath.Dir(j.path)); err != nil {
		return fmt.Errorf("compact journal: %w", err)
	}
	return j.reopenLocked()
}

func (j *FileJournal) reopenLocked() error {
	f, err := os.OpenFile(j.path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return fmt.Errorf("open journal: %w", err)
	}
	j.f = f
	return nil
}

// syncDir fsyncs a directory, so a rename in it survives a crash.
func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("open directory %s: %w", dir, err)
	}
	err = d.Sync()
	if cerr := d.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("fsync directory %s: %w", dir, err)
	}
	return nil
}

// InFlight implements Journal.
func (j *FileJournal) InFlight() []string {
	j.mu.Lock()
	defer j.mu.Unlock()
	out := make([]string, 0, j.inFlight)
	for id, e := range j.m {
		if !e.finished {
			out = append(out, id)
		}
	}
	sort.Strings(out)
	return out
}

// Stats reports the journal's size and contents.
func (j *FileJournal) Stats() JournalStats {
	j.mu.Lock()
	defer j.mu.Unlock()
	return JournalStats{Bytes: j.size, InFlight: j.inFlight, Results: len(j.order) - j.withResult,
		Forgotten: j.withResult, Compactions: j.compactions, CompactErr: j.compactErr, Syncs: j.syncs}
}

// Close fsyncs and closes the file; later Records fail, and Records
// waiting for their fsync return once it is done.
func (j *FileJournal) Close() error {
	j.mu.Lock()
	defer j.mu.Unlock()
	if !j.closed && j.lock != nil {
		defer j.lock.Close() // the lock goes last, after the file is synced
	}
	j.closed = true
	for j.syncing {
		j.synced.Wait()
	}
	defer j.synced.Broadcast()
	if j.f == nil {
		return nil
	}
	err := j.f.Sync()
	if err == nil {
		j.durable = j.appended
	}
	if cerr := j.f.Close(); err == nil {
		err = cerr
	}
	j.f = nil
	if err != nil {
		return fmt.Errorf("close journal: %w", err)
	}
	return nil
}

// lockWait is how long lockFile tries again for a lock that is held. A
// lock is held for a moment after its holder let go when a process forked
// meanwhile (the child shares the open file until it execs), or when the
// previous agent is still exiting as its successor starts; another live
// agent holds it for good and is refused after the wait.
const lockWait = 500 * time.Millisecond

// lockFile opens path and takes an exclusive, non-blocking flock on it,
// trying again for up to lockWait while it is held.
func lockFile(path string) (*os.File, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open the journal's lock: %w", err)
	}
	clk := clockwork.NewRealClock() // the journal takes no clock: the wait is real time by nature
	deadline := clk.Now().Add(lockWait)
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			return f, nil
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) {
			_ = f.Close()
			return nil, fmt.Errorf("lock %s: %w", path, err)
		}
		if clk.Now().After(deadline) {
			_ = f.Close()
			return nil, fmt.Errorf("%s: %w", path, ErrJournalLocked)
		}
		clk.Sleep(10 * time.Millisecond) // polling: flock has no timed wait
	}
}
