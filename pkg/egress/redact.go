package egress

import (
	"errors"
	"net/url"
)

// RedactURL returns what of a user-supplied URL may be printed in a log
// line, an error or an audit row: the scheme, host and port only. The
// userinfo and the query string may carry credentials, and so may the path
// (chat webhooks keep their token there); "/…" marks that something was
// left out. A URL that does not parse is not echoed at all.
func RedactURL(raw string) string {
	u, err := url.Parse(raw)
	if err != nil || u.Host == "" {
		return "(an unparseable URL)"
	}
	out := u.Scheme + "://" + u.Host
	if u.User != nil || (u.Path != "" && u.Path != "/") || u.RawQuery != "" || u.Fragment != "" || u.Opaque != "" {
		out += "/…"
	}
	return out
}

// RedactError rewrites the URL an HTTP client error quotes (*url.Error
// prints it whole, credentials included) with RedactURL, in place, and
// returns err.
func RedactError(err error) error {
	var ue *url.Error
	if errors.As(err, &ue) {
		ue.URL = RedactURL(ue.URL)
	}
	return err
}
