package daemon

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"sort"
	"sync"

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
	return inFlight(j.m)
}

func inFlight(m map[string]entry) []string {
	var out []string
	for id, e := range m {
		if e.executed && e.result == nil {
			out = append(out, id)
		}
	}
	sort.Strings(out)
	return out
}

// FileJournal is a Journal in an append-only file of JSON lines, each
// fsynced before Record returns, loaded in full at open. A torn last line
// (a crash mid-write) is ignored.
type FileJournal struct {
	mu sync.Mutex
	f  *os.File
	m  map[string]entry
}

type fileLine struct {
	Command string          `json:"c"`
	Result  json.RawMessage `json:"r,omitempty"`
}

// OpenFileJournal opens (creating it if needed) the journal at path.
func OpenFileJournal(path string) (*FileJournal, error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open journal: %w", err)
	}
	j := &FileJournal{f: f, m: map[string]entry{}}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 16<<20)
	for sc.Scan() {
		var l fileLine
		if err := json.Unmarshal(sc.Bytes(), &l); err != nil || l.Command == "" {
			continue // torn write
		}
		e := entry{executed: true}
		if len(l.Result) > 0 {
			r := &nodev1.CommandResult{}
			if err := protojson.Unmarshal(l.Result, r); err != nil {
				continue
			}
			e.result = r
		}
		if old, ok := j.m[l.Command]; ok && old.result != nil && e.result == nil {
			continue // a result is final
		}
		j.m[l.Command] = e
	}
	if err := sc.Err(); err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("read journal %s: %w", path, err)
	}
	return j, nil
}

// Seen implements Journal.
func (j *FileJournal) Seen(id string) (*nodev1.CommandResult, bool) {
	j.mu.Lock()
	defer j.mu.Unlock()
	e := j.m[id]
	return e.result, e.executed
}

// Record implements Journal: it appends a line and fsyncs.
func (j *FileJournal) Record(id string, r *nodev1.CommandResult) error {
	l := fileLine{Command: id}
	if r != nil {
		b, err := protojson.Marshal(r)
		if err != nil {
			return fmt.Errorf("journal result of %s: %w", id, err)
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
	if j.f == nil {
		return errors.New("journal is closed")
	}
	if _, err := j.f.Write(b); err != nil {
		return fmt.Errorf("journal %s: %w", id, err)
	}
	if err := j.f.Sync(); err != nil {
		return fmt.Errorf("journal %s: fsync: %w", id, err)
	}
	j.m[id] = entry{result: r, executed: true}
	return nil
}

// InFlight implements Journal.
func (j *FileJournal) InFlight() []string {
	j.mu.Lock()
	defer j.mu.Unlock()
	return inFlight(j.m)
}

// Close closes the file.
func (j *FileJournal) Close() error {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.f == nil {
		return nil
	}
	err := j.f.Close()
	j.f = nil
	return err
}
