package gateway

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	nodev1 "github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1"
	"github.com/leasehold/leasehold/pkg/gen/leasehold/node/v1/nodev1connect"
)

// envClients switches the test binary into the idle-session client of
// BenchmarkIdleSessionMemory: it runs in its own process so the gateway's
// heap delta counts only the gateway's side of each session.
const envClients = "LEASEHOLD_GATEWAY_BENCH_CLIENTS"

// clientMain opens one idle session per "node credential" line of the file
// named by envClients, each on its own connection like a real daemon,
// prints "ready" and holds them until stdin closes.
func clientMain() bool {
	spec := os.Getenv(envClients) // addr=file[=tlsdir]
	if spec == "" {
		return false
	}
	parts := strings.SplitN(spec, "=", 3)
	addr, file := parts[0], parts[1]
	scheme, newClient := "http://", h2cClient
	if len(parts) == 3 { // mTLS: tlsdir holds ca.pem, client.pem, client-key.pem
		tc, err := benchClientTLS(parts[2])
		if err != nil {
			fmt.Println("error:", err)
			os.Exit(1)
		}
		scheme = "https://"
		newClient = func() *http.Client {
			p := new(http.Protocols)
			p.SetHTTP2(true)
			return &http.Client{Transport: &http.Transport{Protocols: p, TLSClientConfig: tc}}
		}
	}
	f, err := os.Open(file)
	if err != nil {
		fmt.Println("error:", err)
		os.Exit(1)
	}
	var lines [][2]string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		node, cred, _ := strings.Cut(sc.Text(), " ")
		lines = append(lines, [2]string{node, cred})
	}
	ctx := context.Background()
	var wg sync.WaitGroup
	sem := make(chan struct{}, 32)
	for _, l := range lines {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			for {
				st := nodev1connect.NewNodeGatewayServiceClient(newClient(), scheme+addr).Connect(ctx)
				_ = st.Send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_Hello{Hello: &nodev1.Hello{
					NodeId: l[0], Credential: l[1], Kind: nodev1.NodeKind_NODE_KIND_NODE}}})
				m, err := st.Receive()
				if err == nil && m.GetWelcome() != nil {
					go func() { // heartbeat so the gateway keeps the session
						for range time.Tick(time.Second) {
							_ = st.Send(&nodev1.ConnectRequest{Msg: &nodev1.ConnectRequest_Heartbeat{Heartbeat: &nodev1.Heartbeat{}}})
						}
					}()
					go func() {
						for {
							if _, err := st.Receive(); err != nil {
								return
							}
						}
					}()
					return
				}
				time.Sleep(100 * time.Millisecond) // back off before redialling a gateway not yet serving
			}
		}()
	}
	wg.Wait()
	fmt.Println("ready")
	_, _ = bufio.NewReader(os.Stdin).ReadString('\n')
	os.Exit(0)
	return true
}

// benchClientTLS loads the idle clients' mTLS configuration from dir.
func benchClientTLS(dir string) (*tls.Config, error) {
	cert, err := tls.LoadX509KeyPair(filepath.Join(dir, "client.pem"), filepath.Join(dir, "client-key.pem"))
	if err != nil {
		return nil, fmt.Errorf("load client certificate: %w", err)
	}
	pem, err := os.ReadFile(filepath.Join(dir, "ca.pem"))
	if err != nil {
		return nil, fmt.Errorf("read CA: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, errors.New("ca.pem holds no certificate")
	}
	return &tls.Config{RootCAs: pool, Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}, nil
}
