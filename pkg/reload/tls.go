package reload

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"sync/atomic"
	"time"
)

// TLSFiles names a server's PEM files.
type TLSFiles struct {
	// Cert and Key are the serving certificate (chain) and its key.
	Cert, Key string
	// ClientCA, when set, is the CA bundle client certificates must chain
	// to (mTLS: tls.RequireAndVerifyClientCert).
	ClientCA string
}

// tlsState is one loaded version of the files.
type tlsState struct {
	cert       *tls.Certificate
	clientCAs  *x509.CertPool
	caNotAfter time.Time
}

// TLS serves a certificate and client CA that follow their files: every new
// handshake uses the newest version that loaded; connections already open
// keep theirs.
type TLS struct {
	*Watcher
	files     TLSFiles
	component string
	base      *tls.Config
	state     atomic.Pointer[tlsState]
}

// NewTLS loads files (an error names the file) and returns a TLS whose
// ServerConfig serves them. base carries the server's other settings
// (MinVersion, NextProtos); its Certificates and ClientCAs are ignored.
// component labels leasehold_tls_certificate_expiry_timestamp_seconds.
func NewTLS(component string, files TLSFiles, base *tls.Config, opts Options) (*TLS, error) {
	if files.Cert == "" || files.Key == "" {
		return nil, errors.New("reload TLS: certificate and key files are both required")
	}
	if base == nil {
		base = &tls.Config{MinVersion: tls.VersionTLS12}
	}
	t := &TLS{files: files, component: component, base: base.Clone()}
	paths := []string{files.Cert, files.Key}
	if files.ClientCA != "" {
		paths = append(paths, files.ClientCA)
	}
	expiry := newExpiry(opts.Registerer)
	w, err := NewWatcher(component+"-tls", paths, func(c [][]byte) error {
		st, err := t.parse(c)
		if err != nil {
			return err
		}
		t.state.Store(st)
		expiry.WithLabelValues(component, "serving").Set(float64(st.cert.Leaf.NotAfter.Unix()))
		if st.clientCAs != nil {
			expiry.WithLabelValues(component, "client_ca").Set(float64(st.caNotAfter.Unix()))
		}
		return nil
	}, opts)
	if err != nil {
		return nil, err
	}
	t.Watcher = w
	return t, nil
}

func (t *TLS) parse(c [][]byte) (*tlsState, error) {
	cert, err := tls.X509KeyPair(c[0], c[1])
	if err != nil {
		return nil, fmt.Errorf("certificate %s / key %s: %w", t.files.Cert, t.files.Key, err)
	}
	// tls.X509KeyPair sets Leaf since Go 1.23.
	if cert.Leaf == nil {
		if cert.Leaf, err = x509.ParseCertificate(cert.Certificate[0]); err != nil {
			return nil, fmt.Errorf("certificate %s: %w", t.files.Cert, err)
		}
	}
	st := &tlsState{cert: &cert}
	if len(c) > 2 {
		pool, notAfter, err := parseCABundle("client CA "+t.files.ClientCA, c[2])
		if err != nil {
			return nil, err
		}
		st.clientCAs, st.caNotAfter = pool, notAfter
	}
	return st, nil
}

// Leaf is the serving certificate in force.
func (t *TLS) Leaf() *x509.Certificate { return t.state.Load().cert.Leaf }

// ServerConfig returns a server configuration whose handshakes use the
// certificate and client CA in force when each handshake starts. The base
// configuration's NextProtos must list every ALPN protocol served: the
// per-handshake configuration is built from it, not from the clone an
// http.Server makes. With a client CA, session resumption is off.
func (t *TLS) ServerConfig() *tls.Config {
	c := t.base.Clone()
	c.Certificates, c.ClientCAs = nil, nil
	c.GetCertificate = func(*tls.ClientHelloInfo) (*tls.Certificate, error) { return t.state.Load().cert, nil }
	c.GetConfigForClient = func(*tls.ClientHelloInfo) (*tls.Config, error) { return t.handshakeConfig(), nil }
	if t.files.ClientCA != "" {
		c.ClientAuth = tls.RequireAndVerifyClientCert
	}
	return c
}

// handshakeConfig is the configuration of one handshake: the base settings
// with the state in force now.
func (t *TLS) handshakeConfig() *tls.Config {
	st := t.state.Load()
	c := t.base.Clone()
	c.GetConfigForClient = nil
	c.GetCertificate = nil
	c.Certificates = []tls.Certificate{*st.cert}
	if st.clientCAs != nil {
		c.ClientCAs, c.ClientAuth = st.clientCAs, tls.RequireAndVerifyClientCert
		// A resumed session is not verified against the CA again: after a
		// CA rotation a ticket would let a client of the old CA back in.
		c.SessionTicketsDisabled = true
	}
	return c
}

// parseCABundle reads every CERTIFICATE block of a PEM bundle (other
// blocks are skipped) into a pool, and returns the earliest NotAfter among
// them. A bundle with none, or with a certificate that does not parse, is
// an error naming it (what: "client CA /etc/ca.pem").
func parseCABundle(what string, b []byte) (*x509.CertPool, time.Time, error) {
	pool := x509.NewCertPool()
	var notAfter time.Time
	for {
		var blk *pem.Block
		blk, b = pem.Decode(b)
		if blk == nil {
			break
		}
		if blk.Type != "CERTIFICATE" {
			continue
		}
		ca, err := x509.ParseCertificate(blk.Bytes)
		if err != nil {
			return nil, time.Time{}, fmt.Errorf("%s: %w", what, err)
		}
		pool.AddCert(ca)
		if notAfter.IsZero() || ca.NotAfter.Before(notAfter) {
			notAfter = ca.NotAfter
		}
	}
	if notAfter.IsZero() {
		return nil, time.Time{}, fmt.Errorf("%s holds no PEM certificate", what)
	}
	return pool, notAfter, nil
}
