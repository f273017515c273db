package daemon_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"time"

	"github.com/leasehold/leasehold/pkg/daemon"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
)

// A node agent is a Handler that executes commands, a journal that
// remembers them across restarts, and Run, which keeps a session with the
// gateway until its context ends. No gateway answers here, so the daemon
// only dials and backs off until it is stopped; it runs nothing.
func Example() {
	dir, err := os.MkdirTemp("", "node")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)

	journal, err := daemon.OpenFileJournal(filepath.Join(dir, "journal.jsonl"))
	if err != nil {
		log.Fatal(err)
	}
	defer journal.Close()

	d, err := daemon.New(daemon.Config{
		Address:    "http://127.0.0.1:1", // the gateways' balancer; h2c here
		NodeID:     "node-1",
		Credential: "the node's credential",
		Labels:     map[string]string{"fleet": "edge"},
		Journal:    journal,
		Handler: func(ctx context.Context, cmd *nodev1.Command) daemon.Outcome {
			return daemon.Outcome{Output: []byte("ran " + cmd.GetKind())}
		},
	})
	if err != nil {
		log.Fatal(err)
	}

	ctx, stop := context.WithTimeout(context.Background(), 200*time.Millisecond) // a signal, in an agent
	defer stop()
	fmt.Println("run:", d.Run(ctx))
	s := d.Stats()
	fmt.Println("dialled:", s.Dials > 0, "welcomed:", s.Welcomes, "executed:", s.Executions)
	// Output:
	// run: <nil>
	// dialled: true welcomed: 0 executed: 0
}

// A Handler runs one command: it streams live output through Stdout and
// Stderr of its ctx and returns how the command ended. The daemon calls it
// at most once per command id; WithOutput runs it without a daemon, as a
// test or a local CLI would.
func ExampleHandler() {
	var handler daemon.Handler = func(ctx context.Context, cmd *nodev1.Command) daemon.Outcome {
		fmt.Fprintf(daemon.Stdout(ctx), "running %s %s\n", cmd.GetKind(), cmd.GetCommandId())
		if cmd.GetKind() != "hello" {
			return daemon.Outcome{ExitCode: -1, Err: "unknown kind " + cmd.GetKind()}
		}
		return daemon.Outcome{Output: []byte("hello from the node")}
	}

	ctx := daemon.WithOutput(context.Background(), os.Stdout, os.Stderr)
	o := handler(ctx, &nodev1.Command{CommandId: "c1", Kind: "hello"})
	fmt.Printf("exit %d, output %q, err %q\n", o.ExitCode, o.Output, o.Err)
	o = handler(ctx, &nodev1.Command{CommandId: "c2", Kind: "reboot"})
	fmt.Printf("exit %d, output %q, err %q\n", o.ExitCode, o.Output, o.Err)
	// Output:
	// running hello c1
	// exit 0, output "hello from the node", err ""
	// running reboot c2
	// exit -1, output "", err "unknown kind reboot"
}

// The journal is what makes execution at most once across restarts: the
// daemon records a command as started before its Handler runs and records
// the result after. After a restart, a command the gateway replays is
// answered from the journal: a finished one with its stored result, one
// that was running when the agent died as interrupted; neither runs again.
func ExampleOpenFileJournal() {
	dir, err := os.MkdirTemp("", "node")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "journal.jsonl")

	// Before the crash: c1 finished, c2 was still running.
	j, err := daemon.OpenFileJournal(path)
	if err != nil {
		log.Fatal(err)
	}
	for _, rec := range []struct {
		id     string
		result *nodev1.CommandResult
	}{
		{"c1", nil},
		{"c1", &nodev1.CommandResult{CommandId: "c1", ResultId: "c1/1", Output: []byte("done")}},
		{"c2", nil},
	} {
		if err := j.Record(rec.id, rec.result); err != nil {
			log.Fatal(err)
		}
	}
	// Only one agent may have the journal open.
	_, err = daemon.OpenFileJournal(path)
	fmt.Println("second open refused:", err != nil)
	if err := j.Close(); err != nil {
		log.Fatal(err)
	}

	// After the restart.
	j, err = daemon.OpenFileJournal(path)
	if err != nil {
		log.Fatal(err)
	}
	defer j.Close()
	fmt.Println("in flight (sent on Hello):", j.InFlight())
	for _, id := range []string{"c1", "c2", "c3"} {
		result, started := j.Seen(id)
		switch {
		case result != nil:
			fmt.Printf("%s: re-send result %s %q\n", id, result.GetResultId(), result.GetOutput())
		case started:
			fmt.Printf("%s: interrupted, not run again\n", id)
		default:
			fmt.Printf("%s: new, run it\n", id)
		}
	}
	// Output:
	// second open refused: true
	// in flight (sent on Hello): [c2]
	// c1: re-send result c1/1 "done"
	// c2: interrupted, not run again
	// c3: new, run it
}

// Backoff spaces the daemon's redials: each delay is drawn from [0, bound],
// the bound doubling from Base up to Max, and Reset once a session has been
// stable starts again from Base. Rand is fixed here only so the example
// prints the same delays every time.
func ExampleBackoff() {
	b := daemon.Backoff{Base: time.Second, Max: 10 * time.Second, Rand: func() float64 { return 0.5 }}
	for range 5 {
		bound := b.Bound()
		fmt.Printf("wait %v (bound %v)\n", b.Next(), bound)
	}
	b.Reset()
	fmt.Println("after a stable session, bound", b.Bound())
	// Output:
	// wait 500ms (bound 1s)
	// wait 1s (bound 2s)
	// wait 2s (bound 4s)
	// wait 4s (bound 8s)
	// wait 5s (bound 10s)
	// after a stable session, bound 1s
}
