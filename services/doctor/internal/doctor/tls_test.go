package doctor_test

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/tlstest"
	"github.com/leasehold/leasehold/services/doctor/internal/doctor"
)

// expiredCert writes a self-signed certificate that expired an hour ago.
func expiredCert(t *testing.T) string {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(7), Subject: pkix.Name{CommonName: "old gateway"},
		NotBefore: time.Now().Add(-48 * time.Hour), NotAfter: time.Now().Add(-time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	require.NoError(t, err)
	path := filepath.Join(t.TempDir(), "expired.pem")
	require.NoError(t, os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600))
	return path
}

// TestTLSExpiry: the certificates of the files given are judged against the
// thresholds (tlstest certificates expire in 24 h, so the defaults of 14 and
// 3 days would call them critical); no files is ok with a note, an
// unreadable file is not checked.
func TestTLSExpiry(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ca := tlstest.NewCA(t)
	serving, _ := tlstest.WriteKeyPair(t, ca.Server(t))
	caFile := ca.WriteCA(t)

	requireFinding(t, b.check(t, doctor.CodeTLSExpiry), doctor.SeverityOK, "no certificate files given")

	require.NoError(t, b.cfg.TLSCertFiles.Set(serving+", "+caFile))
	b.cfg.TLSExpiryWarn, b.cfg.TLSExpiryCritical = 12*time.Hour, time.Hour
	f := b.check(t, doctor.CodeTLSExpiry)
	requireFinding(t, f, doctor.SeverityOK, "2 certificates in 2 files")
	requireEvidence(t, f, "certificate", "CN=localhost", serving)

	b.cfg.TLSExpiryWarn, b.cfg.TLSExpiryCritical = 48*time.Hour, 12*time.Hour
	requireFinding(t, b.check(t, doctor.CodeTLSExpiry), doctor.SeverityWarn, "2 certificates expire within --tls-expiry-warn 48h0m0s")

	b.cfg.TLSExpiryCritical = 30 * time.Hour
	requireFinding(t, b.check(t, doctor.CodeTLSExpiry), doctor.SeverityCritical, "within --tls-expiry-critical 30h0m0s")

	require.NoError(t, b.cfg.TLSCertFiles.Set(serving+","+expiredCert(t)))
	requireFinding(t, b.check(t, doctor.CodeTLSExpiry), doctor.SeverityCritical, "1 certificate has expired: CN=old gateway")

	require.NoError(t, b.cfg.TLSCertFiles.Set(filepath.Join(t.TempDir(), "missing.pem")))
	requireFinding(t, b.check(t, doctor.CodeTLSExpiry), doctor.SeverityUnknown, "missing.pem")
}

func TestTLSExpiryThresholdsValidated(t *testing.T) {
	t.Parallel()
	cfg := doctor.DefaultConfig()
	cfg.TLSExpiryWarn, cfg.TLSExpiryCritical = time.Hour, 2*time.Hour
	require.ErrorContains(t, cfg.Validate(), "--tls-expiry-warn 1h0m0s must not be shorter than --tls-expiry-critical 2h0m0s")
}
