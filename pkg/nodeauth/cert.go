package nodeauth

import (
	"crypto/x509"
	"errors"
	"fmt"
	"net/url"
	"strings"
)

// URIScheme is the scheme of leasehold URI SANs; a client certificate names
// node <id> with the URI SAN "leasehold://node/<id>".
const URIScheme = "leasehold"

// NodeURI is the URI SAN that names node id in a client certificate.
func NodeURI(id string) string { return URIScheme + "://node/" + id }

// NodeIDFromCert's errors wrap one of these: a certificate that names no
// node, one that names more than one, or one with a leasehold URI SAN that
// is not spelled leasehold://node/<id>.
var (
	ErrCertNoNode     = errors.New("client certificate names no node")
	ErrCertManyNodes  = errors.New("client certificate names more than one node")
	ErrCertBadNodeURI = errors.New("client certificate has a malformed leasehold URI SAN")
)

// NodeIDFromCert returns the one node a client certificate names:
//
//   - the <id> of its URI SAN "leasehold://node/<id>", when it has one;
//   - otherwise, only when it has no URI SAN with the leasehold scheme at
//     all, its subject CommonName.
//
// A nil error always comes with exactly one id that passes ValidateNodeID.
// Refused, with an error and no id:
//
//   - URI SANs naming two different nodes (ErrCertManyNodes; the same URI
//     repeated names one node);
//   - a leasehold URI SAN that is not exactly leasehold://node/<valid id>
//     (ErrCertBadNodeURI: another host, a port, user, query, fragment,
//     further path segment or percent-escape), even beside a good one; a
//     malformed leasehold URI never falls back to the CommonName;
//   - no leasehold URI SAN and a CommonName that is not a valid node id
//     (ErrCertNoNode).
//
// DNS, IP and e-mail SANs and URI SANs of other schemes are ignored. It only
// reads the certificate: the caller must have verified it (a TLS handshake
// with tls.RequireAndVerifyClientCert does).
func NodeIDFromCert(cert *x509.Certificate) (string, error) {
	if cert == nil {
		return "", fmt.Errorf("%w: no certificate", ErrCertNoNode)
	}
	var named string
	for _, u := range cert.URIs {
		if u == nil || !strings.EqualFold(u.Scheme, URIScheme) {
			continue
		}
		id, err := nodeIDFromURI(u)
		if err != nil {
			return "", err
		}
		if named != "" && named != id {
			return "", fmt.Errorf("%w: URI SANs name %q and %q", ErrCertManyNodes, named, id)
		}
		named = id
	}
	if named != "" {
		return named, nil
	}
	cn := cert.Subject.CommonName
	if err := ValidateNodeID(cn); err != nil {
		return "", fmt.Errorf("%w: no %s URI SAN, and the subject common name is not a node id: %w", ErrCertNoNode, NodeURI("<id>"), err)
	}
	return cn, nil
}

// nodeIDFromURI reads <id> from leasehold://node/<id>, spelled exactly so.
func nodeIDFromURI(u *url.URL) (string, error) {
	bad := func(why string) error {
		return fmt.Errorf("%w: %q is not %s: %s", ErrCertBadNodeURI, truncate(u.String(), 80), NodeURI("<id>"), why)
	}
	switch {
	case u.Opaque != "":
		return "", bad("opaque URI")
	case !strings.EqualFold(u.Host, "node"):
		return "", bad(`host is not "node"`)
	case u.User != nil:
		return "", bad("carries user information")
	case u.RawQuery != "" || u.ForceQuery:
		return "", bad("carries a query")
	case u.Fragment != "" || u.RawFragment != "":
		return "", bad("carries a fragment")
	case !strings.HasPrefix(u.Path, "/"):
		return "", bad("no node id")
	}
	id := strings.TrimPrefix(u.Path, "/")
	if err := ValidateNodeID(id); err != nil {
		return "", bad(err.Error())
	}
	if u.RawPath != "" {
		return "", bad("node id is percent-escaped")
	}
	return id, nil
}
