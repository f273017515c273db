package api

import (
	"encoding/base64"
	"encoding/json"
	"time"
)

// A page token is the base64url JSON of the last key of the previous page,
// tagged with the method that issued it. Clients must treat it as opaque.
type pageKey struct {
	// Method is the method that issued the token.
	Method string `json:"m"`
	// ID is the last row's id (or name).
	ID string `json:"k"`
	// At is the last row's created_at in Unix microseconds, for lists
	// ordered newest first.
	At int64 `json:"t,omitempty"`
}

func encodePage(k pageKey) string {
	b, _ := json.Marshal(k)
	return base64.RawURLEncoding.EncodeToString(b)
}

// decodePage returns the key of token for method; "" gives the zero key.
func decodePage(method, token string) (pageKey, error) {
	if token == "" {
		return pageKey{}, nil
	}
	b, err := base64.RawURLEncoding.DecodeString(token)
	var k pageKey
	if err != nil || json.Unmarshal(b, &k) != nil || k.Method != method || k.ID == "" || len(k.ID) > 200 {
		return pageKey{}, invalid("page_token", "is not a page token of %s", method)
	}
	return k, nil
}

func (k pageKey) time() time.Time { return time.UnixMicro(k.At) }

// after returns the time of the last row of the previous page, or nil on
// the first page: the keyset bound of newest-first lists.
func (k pageKey) after() *time.Time {
	if k.ID == "" {
		return nil
	}
	t := k.time()
	return &t
}
