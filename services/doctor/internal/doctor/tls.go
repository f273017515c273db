package doctor

import (
	"context"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"
)

// CodeTLSExpiry reports certificates that expire soon.
const CodeTLSExpiry = "tls.expiry"

// certFiles is the value of --tls-cert-files: comma-separated PEM files.
type certFiles []string

func (c *certFiles) String() string { return strings.Join(*c, ",") }

// Set parses "a.pem,b.pem".
func (c *certFiles) Set(v string) error {
	var out []string
	for p := range strings.SplitSeq(v, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	*c = out
	return nil
}

// pemCert is one certificate of a file, for evidence.
type pemCert struct {
	file     string
	subject  string
	serial   string
	notAfter time.Time
	left     time.Duration
}

func (c pemCert) String() string {
	return fmt.Sprintf("%s: %s (serial %s) expires %s, in %s", c.file, c.subject, c.serial, c.notAfter.UTC().Format(time.RFC3339), dur(c.left))
}

// readCerts parses every CERTIFICATE block of path.
func readCerts(path string, now time.Time) ([]pemCert, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var out []pemCert
	for {
		var b *pem.Block
		b, raw = pem.Decode(raw)
		if b == nil {
			break
		}
		if b.Type != "CERTIFICATE" {
			continue
		}
		c, err := x509.ParseCertificate(b.Bytes)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		subject := c.Subject.String()
		if subject == "" {
			subject = "(no subject)"
		}
		out = append(out, pemCert{file: path, subject: subject, serial: c.SerialNumber.Text(16), notAfter: c.NotAfter, left: c.NotAfter.Sub(now)})
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%s holds no PEM certificate", path)
	}
	return out, nil
}

// checkTLSExpiry reads the certificate files given by --tls-cert-files (the
// same Secrets the gateway and api mount: serving chains and client CA
// bundles) and compares every certificate's NotAfter with the database
// clock. The services also export the certificate they actually serve as
// leasehold_tls_certificate_expiry_timestamp_seconds for alerting.
func checkTLSExpiry(ctx context.Context, d *Doctor) (Finding, error) {
	if len(d.cfg.TLSCertFiles) == 0 {
		return ok("no certificate files given (--tls-cert-files): nothing to judge; alert on leasehold_tls_certificate_expiry_timestamp_seconds instead"), nil
	}
	now, err := d.now(ctx)
	if err != nil {
		return Finding{}, fmt.Errorf("read the database clock: %w", err)
	}
	var certs []pemCert
	var unreadable []error
	for _, p := range d.cfg.TLSCertFiles {
		cs, err := readCerts(p, now)
		if err != nil {
			unreadable = append(unreadable, err)
			continue
		}
		certs = append(certs, cs...)
	}
	if len(unreadable) > 0 {
		return unchecked(errors.Join(unreadable...).Error(),
			"mount the certificate Secrets into the doctor and give their paths in --tls-cert-files"), nil
	}
	slices.SortFunc(certs, func(a, b pemCert) int { return a.notAfter.Compare(b.notAfter) })
	var expired, near, warned []pemCert
	for _, c := range certs {
		switch {
		case c.left <= 0:
			expired = append(expired, c)
		case c.left <= d.cfg.TLSExpiryCritical:
			near = append(near, c)
		case c.left <= d.cfg.TLSExpiryWarn:
			warned = append(warned, c)
		}
	}
	const hint = "renew the certificate (cert-manager: check the Certificate's status and events); the gateway and api " +
		"pick up the renewed files without a restart (docs/runbooks.md, certificate rotation)"
	soonest := certs[0]
	var f Finding
	switch {
	case len(expired) > 0:
		f = critical(fmt.Sprintf("%s expired: %s", plural(len(expired), "certificate has", "certificates have"), expired[0].subject), hint)
	case len(near) > 0:
		f = critical(fmt.Sprintf("%s within --tls-expiry-critical %s: %s in %s", plural(len(near), "certificate expires", "certificates expire"),
			dur(d.cfg.TLSExpiryCritical), near[0].subject, dur(near[0].left)), hint)
	case len(warned) > 0:
		f = warn(fmt.Sprintf("%s within --tls-expiry-warn %s: %s in %s", plural(len(warned), "certificate expires", "certificates expire"),
			dur(d.cfg.TLSExpiryWarn), warned[0].subject, dur(warned[0].left)), hint)
	default:
		f = ok(fmt.Sprintf("%s in %s, the soonest in %s", plural(len(certs), "certificate", "certificates"),
			plural(len(d.cfg.TLSCertFiles), "file", "files"), dur(soonest.left)))
	}
	capped(&f, "certificate", certs, pemCert.String)
	return f, nil
}
