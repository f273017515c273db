package faultproxy_test

import (
	"bufio"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/leasehold/leasehold/pkg/faultproxy"
)

func echoServer(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				r := bufio.NewReader(c)
				for {
					line, err := r.ReadString('\n')
					if err != nil {
						return
					}
					if _, err := c.Write([]byte(line)); err != nil {
						return
					}
				}
			}()
		}
	}()
	return ln.Addr().String()
}

func roundTrip(c net.Conn, timeout time.Duration) error {
	_ = c.SetDeadline(time.Now().Add(timeout))
	if _, err := c.Write([]byte("ping\n")); err != nil {
		return err
	}
	_, err := bufio.NewReader(c).ReadString('\n')
	return err
}

func TestProxyFaults(t *testing.T) {
	t.Cleanup(func() { goleak.VerifyNone(t) }) // runs last, after the echo server closes
	p, err := faultproxy.New(echoServer(t))
	require.NoError(t, err)
	defer p.Close()

	c, err := net.Dial("tcp", p.Addr())
	require.NoError(t, err)
	defer c.Close()
	require.NoError(t, roundTrip(c, time.Second))

	p.SetLatency(100 * time.Millisecond)
	start := time.Now()
	require.NoError(t, roundTrip(c, 2*time.Second))
	require.GreaterOrEqual(t, time.Since(start), 200*time.Millisecond, "latency applies in both directions")
	p.Restore()

	p.Blackhole()
	err = roundTrip(c, 300*time.Millisecond)
	var ne net.Error
	require.ErrorAs(t, err, &ne)
	require.True(t, ne.Timeout(), "a blackholed peer times out, it is not reset")
	p.Restore()

	p.CutAll()
	require.Error(t, roundTrip(c, time.Second))

	p.Refuse()
	c2, err := net.Dial("tcp", p.Addr())
	require.NoError(t, err)
	defer c2.Close()
	require.Error(t, roundTrip(c2, time.Second), "refused connections are closed at once")
}

func TestBalancerFailsOverToTheNextTarget(t *testing.T) {
	t.Cleanup(func() { goleak.VerifyNone(t) })
	dead, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	deadAddr := dead.Addr().String()
	dead.Close()
	p, err := faultproxy.NewBalancer(deadAddr, echoServer(t))
	require.NoError(t, err)
	defer p.Close()
	c, err := net.Dial("tcp", p.Addr())
	require.NoError(t, err)
	defer c.Close()
	require.NoError(t, roundTrip(c, 2*time.Second))
}
