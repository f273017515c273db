package reload

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"strings"
	"sync/atomic"

	"github.com/leasehold/leasehold/pkg/nodeauth"
)

// ClientTLSFiles names a client's PEM files: the CA bundle its servers'
// certificates must chain to, and an optional client certificate for mTLS.
type ClientTLSFiles struct {
	// CA is the CA bundle; empty means the system's roots.
	CA string
	// Cert and Key are the client certificate (chain) and its key; both or
	// neither.
	Cert, Key string
}

// RegisterFlags registers --<prefix>tls.ca-file, --<prefix>tls.cert-file and
// --<prefix>tls.key-file on f.
func (c *ClientTLSFiles) RegisterFlags(prefix string, f *flag.FlagSet) {
	f.StringVar(&c.CA, prefix+"tls.ca-file", "", "CA bundle (PEM) the gateway's certificate must chain to (default: the system's roots); re-read on change")
	f.StringVar(&c.Cert, prefix+"tls.cert-file", "", "client certificate (PEM) for mTLS, with --"+prefix+"tls.key-file; re-read on change")
	f.StringVar(&c.Key, prefix+"tls.key-file", "", "key (PEM) of --"+prefix+"tls.cert-file")
}

// Empty reports whether no file is named.
func (c ClientTLSFiles) Empty() bool { return c.CA == "" && c.Cert == "" && c.Key == "" }

// clientState is one loaded version of a client's files.
type clientState struct {
	roots *x509.CertPool // nil: the system's
	cert  *tls.Certificate
}

// ClientTLS is a client TLS configuration that follows its files: every new
// handshake uses the CA bundle and client certificate of the newest version
// that loaded; a version that fails to load (a file half written, a key
// that does not match its certificate) leaves the previous one in force.
type ClientTLS struct {
	*Watcher
	files ClientTLSFiles
	state atomic.Pointer[clientState]
}

// NewClientTLS loads files (an error names the file) and returns a
// ClientTLS; call Run (from the embedded Watcher) to follow changes.
// component names the watcher in logs and metrics.
func NewClientTLS(component string, files ClientTLSFiles, opts Options) (*ClientTLS, error) {
	if (files.Cert == "") != (files.Key == "") {
		return nil, errors.New("reload client TLS: the client certificate and key files go together")
	}
	t := &ClientTLS{files: files}
	var paths []string
	for _, p := range []string{files.CA, files.Cert, files.Key} {
		if p != "" {
			paths = append(paths, p)
		}
	}
	if len(paths) == 0 {
		t.state.Store(&clientState{})
		return t, nil
	}
	expiry := newExpiry(opts.Registerer)
	w, err := NewWatcher(component+"-client-tls", paths, func(c [][]byte) error {
		st, err := t.parse(c)
		if err != nil {
			return err
		}
		t.state.Store(st)
		if st.cert != nil {
			expiry.WithLabelValues(component, "client").Set(float64(st.cert.Leaf.NotAfter.Unix()))
		}
		return nil
	}, opts)
	if err != nil {
		return nil, err
	}
	t.Watcher = w
	return t, nil
}

func (t *ClientTLS) parse(c [][]byte) (*clientState, error) {
	st := &clientState{}
	i := 0
	if t.files.CA != "" {
		pool, _, err := parseCABundle("CA file "+t.files.CA, c[i])
		if err != nil {
			return nil, err
		}
		st.roots = pool
		i++
	}
	if t.files.Cert != "" {
		cert, err := tls.X509KeyPair(c[i], c[i+1])
		if err != nil {
			return nil, fmt.Errorf("client certificate %s / key %s: %w", t.files.Cert, t.files.Key, err)
		}
		if cert.Leaf == nil {
			if cert.Leaf, err = x509.ParseCertificate(cert.Certificate[0]); err != nil {
				return nil, fmt.Errorf("client certificate %s: %w", t.files.Cert, err)
			}
		}
		st.cert = &cert
	}
	return st, nil
}

// Leaf is the client certificate in force; nil without one.
func (t *ClientTLS) Leaf() *x509.Certificate {
	if st := t.state.Load(); st.cert != nil {
		return st.cert.Leaf
	}
	return nil
}

// Config returns a client configuration for serverName (empty: the host
// dialled) whose handshakes verify the server against the CA bundle in
// force when each handshake starts and present the client certificate in
// force. Go's client has no per-handshake configuration hook, so the
// chain is verified in VerifyConnection, as crypto/tls documents for
// custom verification, with InsecureSkipVerify turning off only the
// built-in check that it replaces.
func (t *ClientTLS) Config() *tls.Config {
	return &tls.Config{
		MinVersion:         tls.VersionTLS12,
		InsecureSkipVerify: true, //nolint:gosec // verified in VerifyConnection against the reloaded roots
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			if st := t.state.Load(); st.cert != nil {
				return st.cert, nil
			}
			return &tls.Certificate{}, nil // none: the server decides
		},
		VerifyConnection: func(cs tls.ConnectionState) error {
			if len(cs.PeerCertificates) == 0 {
				return errors.New("tls: the server sent no certificate")
			}
			opts := x509.VerifyOptions{
				Roots:         t.state.Load().roots,
				DNSName:       cs.ServerName,
				Intermediates: x509.NewCertPool(),
			}
			for _, c := range cs.PeerCertificates[1:] {
				opts.Intermediates.AddCert(c)
			}
			_, err := cs.PeerCertificates[0].Verify(opts)
			return err
		},
	}
}

// Validate checks the files against the URL of the gateway they are for,
// naming the flags as RegisterFlags registered them under prefix: files
// need an https:// URL, and the certificate and key go together.
func (c ClientTLSFiles) Validate(prefix, gatewayURL string) error {
	var errs []error
	if !c.Empty() && !strings.HasPrefix(gatewayURL, "https://") {
		errs = append(errs, fmt.Errorf("--%stls.* files are given but --%sgateway-url %q is not https://", prefix, prefix, gatewayURL))
	}
	if (c.Cert == "") != (c.Key == "") {
		errs = append(errs, fmt.Errorf("--%stls.cert-file and --%stls.key-file go together", prefix, prefix))
	}
	return errors.Join(errs...)
}

// NewNodeClientTLS is NewClientTLS for an agent that joins the gateways
// as node nodeID: a client certificate that names another node (its
// leasehold URI SAN, pkg/nodeauth) is refused at start, naming the file,
// instead of every Hello being refused later.
func NewNodeClientTLS(component string, files ClientTLSFiles, nodeID string, opts Options) (*ClientTLS, error) {
	t, err := NewClientTLS(component, files, opts)
	if err != nil {
		return nil, err
	}
	if leaf := t.Leaf(); leaf != nil {
		if id, err := nodeauth.NodeIDFromCert(leaf); err == nil && id != nodeID {
			return nil, fmt.Errorf("client certificate %s names node %q, not %q", files.Cert, id, nodeID)
		}
	}
	return t, nil
}
