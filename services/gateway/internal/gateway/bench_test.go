package gateway

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/cmdwake"
	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1/nodev1connect"
	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/tlstest"
)

// BenchmarkHello measures the Hellos per second one gateway sustains
// (authentication + the fenced Hello transaction + Welcome), admission
// limits lifted, clients in the same process on the same cores.
func BenchmarkHello(b *testing.B) {
	db := pgtest.NewDB(b)
	cfg := testConfig()
	cfg.HelloRate, cfg.HelloBurst = 1e9, 1e9
	g := startGateway(b, db, cfg)
	const nodes = 256
	creds := registerNodes(b, db, "b", nodes)
	hc := h2cClient()
	defer hc.CloseIdleConnections()
	client := nodev1connect.NewNodeGatewayServiceClient(hc, "http://"+g.Addr())
	var seq atomic.Int64
	b.ResetTimer()
	start := time.Now()
	b.SetParallelism(8)
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			i := int(seq.Add(1)) % nodes
			ctx, cancel := context.WithCancel(context.Background())
			st := client.Connect(ctx)
			_ = st.Send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_Hello{Hello: &nodev1.Hello{
				NodeId: fmt.Sprintf("b-%d", i), Credential: creds[i], Kind: nodev1.NodeKind_NODE_KIND_NODE}}})
			m, err := st.Receive()
			if err != nil || m.GetWelcome() == nil {
				b.Errorf("hello: %v", err)
			}
			_ = st.CloseRequest()
			cancel()
			_ = st.CloseResponse()
		}
	})
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "hellos/s")
}

// benchNode starts a gateway whose dispatch poll is only the fallback,
// with one welcomed node <prefix>-0, and a creator's coalesced wake-up (as
// the api sends it), closed at cleanup.
func benchNode(b *testing.B, prefix string) (*pgtest.DB, *rawSession, *cmdwake.Notifier) {
	b.Helper()
	db := pgtest.NewDB(b)
	cfg := testConfig()
	cfg.DispatchPoll = time.Second
	g := startGateway(b, db, cfg)
	creds := registerNodes(b, db, prefix, 1)
	s := dialRaw(b, g.Addr())
	s.welcome(b, prefix+"-0", creds[0])
	wake := cmdwake.New(db.Pool, cmdwake.DefaultInterval, nil)
	b.Cleanup(wake.Close)
	return db, s, wake
}

// BenchmarkDispatchLatency measures command insert (committed) to receipt
// on the node's stream, woken by the creator's coalesced NOTIFY
// (pkg/cmdwake, as the api sends it), as p50 and p99.
func BenchmarkDispatchLatency(b *testing.B) {
	db, s, wake := benchNode(b, "d")
	lat := make([]time.Duration, 0, b.N)
	ctx := context.Background()
	b.ResetTimer()
	for range b.N {
		start := time.Now()
		if _, err := db.Pool.Exec(ctx, `INSERT INTO commands (node_id, kind) VALUES ('d-0', 'exec')`); err != nil {
			b.Fatal(err)
		}
		wake.Created("d-0")
		for {
			m, err := s.stream.Receive()
			if err != nil {
				b.Fatal(err)
			}
			if m.GetCommand() != nil {
				break
			}
		}
		lat = append(lat, time.Since(start))
	}
	b.StopTimer()
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1000, "p50-ms")
	b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds())/1000, "p99-ms")
}

// sessionHeapProfile, when set, makes BenchmarkIdleSessionMemory* write a
// heap profile (one sample per 512 allocated bytes) of the gateway holding its idle
// sessions: go tool pprof -sample_index=inuse_space <file>.
var sessionHeapProfile = flag.String("session-heap-profile", "", "write a heap profile of the idle sessions to this file (BenchmarkIdleSessionMemory*)")

// BenchmarkIdleSessionMemory measures the gateway's memory per idle session:
// the heap and goroutine-stack growth for N sessions (clients in a child
// process, each on its own h2c connection) divided by N, after a GC.
func BenchmarkIdleSessionMemory(b *testing.B) { benchIdleSessionMemory(b, false) }

// BenchmarkIdleSessionMemoryTLS is BenchmarkIdleSessionMemory over mTLS
// (one client certificate for every node, node-id binding off).
func BenchmarkIdleSessionMemoryTLS(b *testing.B) { benchIdleSessionMemory(b, true) }

func benchIdleSessionMemory(b *testing.B, withTLS bool) {
	const n = 2000
	db := pgtest.NewDB(b)
	cfg := testConfig()
	cfg.HelloRate, cfg.HelloBurst = 1e9, 1e9
	cfg.LivenessInterval, cfg.HeartbeatInterval, cfg.SessionLease = time.Second, 2*time.Second, 10*time.Second
	spec := ""
	if withTLS {
		dir := b.TempDir()
		ca := tlstest.NewCA(b)
		cfg.TLSCert, cfg.TLSKey = tlstest.WriteKeyPair(b, ca.Server(b))
		cfg.TLSClientCA = ca.WriteCA(b)
		cfg.TLSBindNodeID = false
		cert, key := tlstest.WriteKeyPair(b, ca.Client(b, "bench-client"))
		for name, src := range map[string]string{"ca.pem": cfg.TLSClientCA, "client.pem": cert, "client-key.pem": key} {
			pem, err := os.ReadFile(src)
			require.NoError(b, err)
			require.NoError(b, os.WriteFile(filepath.Join(dir, name), pem, 0o600))
		}
		spec = "=" + dir
	}
	if *sessionHeapProfile != "" {
		old := runtime.MemProfileRate
		runtime.MemProfileRate = 512
		defer func() { runtime.MemProfileRate = old }()
	}
	g := startGateway(b, db, cfg)
	creds := registerNodes(b, db, "m", n)
	file := filepath.Join(b.TempDir(), "creds")
	var lines []byte
	for i, c := range creds {
		lines = fmt.Appendf(lines, "m-%d %s\n", i, c)
	}
	require.NoError(b, os.WriteFile(file, lines, 0o600))

	// Open every database connection the pool may hold before the
	// baseline: they are a fixed cost (about 2 MiB), not a session's.
	conns := make([]*pgxpool.Conn, db.Pool.Config().MaxConns)
	for i := range conns {
		c, err := db.Pool.Acquire(context.Background())
		require.NoError(b, err)
		conns[i] = c
	}
	for _, c := range conns {
		c.Release()
	}
	before, beforeStack := memInUse()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), envClients+"="+g.Addr()+"="+file+spec)
	stdin, err := cmd.StdinPipe()
	require.NoError(b, err)
	stdout, err := cmd.StdoutPipe()
	require.NoError(b, err)
	require.NoError(b, cmd.Start())
	defer func() { _ = stdin.Close(); _ = cmd.Wait() }()
	line, err := bufio.NewReader(stdout).ReadString('\n')
	require.NoError(b, err)
	require.Equal(b, "ready\n", line)
	require.Eventually(b, func() bool { return g.SessionCount() == n }, 30*time.Second, 10*time.Millisecond)
	time.Sleep(3 * time.Second) // a few heartbeats and liveness ticks
	after, afterStack := memInUse()
	per := float64(after-before) / n
	b.ReportMetric(per, "B/session")
	b.ReportMetric(float64(afterStack-beforeStack)/n, "stack-B/session")
	b.ReportMetric(float64(runtime.NumGoroutine())/n, "goroutines/session")
	b.ReportMetric(float64(after-before)/(1<<20)*5000/n, "MiB/5000-sessions")
	if *sessionHeapProfile != "" {
		f, err := os.Create(*sessionHeapProfile)
		require.NoError(b, err)
		require.NoError(b, pprof.Lookup("heap").WriteTo(f, 0))
		require.NoError(b, f.Close())
		b.Logf("heap profile written to %s (go tool pprof -sample_index=inuse_space -top %s)", *sessionHeapProfile, *sessionHeapProfile)
	}
}

// memInUse returns heap + stacks, and stacks alone, after a GC.
func memInUse() (int64, int64) {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return int64(m.HeapAlloc + m.StackInuse), int64(m.StackInuse)
}

// BenchmarkOneNodeBurst measures how fast one node works through a burst
// of 100 commands when it answers each at once: from the burst's insert
// (one transaction, one coalesced wake-up) to the last result committed.
// It is bound by how many of a node's results share a group commit and by
// the node window (--gateway.node-window) refilling. An op is one burst.
//
//	cd services/gateway && go test -run '^$' -bench OneNodeBurst -benchtime 20x ./internal/gateway/
func BenchmarkOneNodeBurst(b *testing.B) {
	const burst = 100
	db, s, wake := benchNode(b, "burst")
	ctx := context.Background()
	// The node: ack and answer every command as it arrives.
	nodeErr := make(chan error, 1)
	go func() {
		for {
			m, err := s.stream.Receive()
			if err != nil {
				nodeErr <- err
				return
			}
			c := m.GetCommand()
			if c == nil {
				continue
			}
			for _, req := range []*nodev1.ConnectRequest{
				{Msg: &nodev1.ConnectRequest_CommandAck{CommandAck: &nodev1.CommandAck{CommandId: c.GetCommandId()}}},
				{Msg: &nodev1.ConnectRequest_CommandResult{CommandResult: &nodev1.CommandResult{CommandId: c.GetCommandId(), ResultId: c.GetCommandId() + "/1"}}},
			} {
				if err := s.stream.Send(req); err != nil {
					nodeErr <- err
					return
				}
			}
		}
	}()
	lat := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for i := range b.N {
		start := time.Now()
		if _, err := db.Pool.Exec(ctx, `INSERT INTO commands (node_id, kind) SELECT 'burst-0', 'exec' FROM generate_series(1, $1)`, burst); err != nil {
			b.Fatal(err)
		}
		wake.Created("burst-0")
		for done := 0; done < (i+1)*burst; {
			select {
			case err := <-nodeErr:
				b.Fatal(err)
			default:
			}
			if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM commands WHERE node_id = 'burst-0' AND state = 'succeeded'`).Scan(&done); err != nil {
				b.Fatal(err)
			}
			if done < (i+1)*burst {
				time.Sleep(time.Millisecond) // poll interval of a loop bounded by the burst's completion
			}
		}
		lat = append(lat, time.Since(start))
	}
	b.StopTimer()
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1000, "p50-ms")
	b.ReportMetric(burst/lat[len(lat)/2].Seconds(), "cmds/s")
}
