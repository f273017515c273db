package gateway

import (
	"bytes"
	"context"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/pgtest"
)

// BenchmarkOutputFlood100MiB streams 100 MiB of one command's output
// through one raw session at full speed (64 KiB pieces, heartbeats every
// 200 ms) and reports the process's peak RSS (VmHWM: the gateway and the
// client together) and the longest wait for a HeartbeatAck. Run it alone,
// once: cd services/gateway && go test -run '^$' -bench OutputFlood -benchtime 1x ./internal/gateway/
// (LEASEHOLD_BENCH_OUTPUT_CAP sets --gateway.output-cap; default 1 MiB).
func BenchmarkOutputFlood100MiB(b *testing.B) {
	db := pgtest.NewDB(b)
	cfg := testConfig()
	cfg.HeartbeatInterval = 200 * time.Millisecond
	if v := os.Getenv("LEASEHOLD_BENCH_OUTPUT_CAP"); v != "" {
		n, err := strconv.ParseInt(v, 10, 64)
		require.NoError(b, err)
		cfg.OutputCap = n
	}
	g := startGateway(b, db, cfg)
	creds := registerNodes(b, db, "n", 1)
	for range b.N {
		s := dialRaw(b, g.Addr())
		s.welcome(b, "n-0", creds[0])
		id := insertCommand(b, db, "n-0", "exec")
		m, err := s.recv(b, 10*time.Second)
		require.NoError(b, err)
		require.Equal(b, id, m.GetCommand().GetCommandId())
		acks := make(chan time.Time, 4096)
		go func() {
			for {
				m, err := s.stream.Receive()
				if err != nil {
					close(acks)
					return
				}
				if m.GetHeartbeatAck() != nil {
					acks <- time.Now()
				}
			}
		}()
		data := bytes.Repeat([]byte("f"), 64<<10)
		start := time.Now()
		next := start
		var seq uint64
		for off := int64(0); off < 100<<20; off += int64(len(data)) {
			if time.Now().After(next) {
				seq++
				require.NoError(b, s.stream.Send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_Heartbeat{Heartbeat: &nodev1.Heartbeat{Sequence: seq}}}))
				next = time.Now().Add(cfg.HeartbeatInterval)
			}
			require.NoError(b, s.stream.Send(outputMsg(id, off, nodev1.OutputStream_OUTPUT_STREAM_STDOUT, string(data))))
		}
		seq++
		require.NoError(b, s.stream.Send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_Heartbeat{Heartbeat: &nodev1.Heartbeat{Sequence: seq}}}))
		sent := time.Since(start)
		want := min(cfg.OutputCap, 100<<20)
		require.Eventually(b, func() bool {
			var n int64
			require.NoError(b, db.Pool.QueryRow(context.Background(),
				`SELECT coalesce(sum(length(data)), 0) FROM command_output WHERE command_id = $1`, id).Scan(&n))
			return n == want
		}, 5*time.Minute, 20*time.Millisecond)
		stored := time.Since(start)
		last, gap, n := start, time.Duration(0), 0
		for len(acks) > 0 {
			t := <-acks
			gap, last, n = max(gap, t.Sub(last)), t, n+1
		}
		b.ReportMetric(float64(peakRSS(b))/(1<<20), "peak-RSS-MiB")
		b.ReportMetric(sent.Seconds(), "sent-s")
		b.ReportMetric(stored.Seconds(), "stored-s")
		b.ReportMetric(gap.Seconds(), "longest-ack-gap-s")
		b.ReportMetric(float64(g.queuedOutputPeak.Load())/(1<<20), "queued-peak-MiB")
		b.Logf("heartbeats %d, acks %d", seq, n)
	}
}

// peakRSS is the process's VmHWM in bytes.
func peakRSS(b *testing.B) int64 {
	raw, err := os.ReadFile("/proc/self/status")
	require.NoError(b, err)
	for _, l := range strings.Split(string(raw), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmHWM:" {
			kb, err := strconv.ParseInt(f[1], 10, 64)
			require.NoError(b, err)
			return kb << 10
		}
	}
	b.Fatal("no VmHWM in /proc/self/status")
	return 0
}
