package api

import (
	"encoding/base64"
	"encoding/json"
	"time"

	"github.com/jackc/pgx/v5"
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

// page is one request's position in a keyset-paginated list.
type page struct {
	method string
	// after is the last key of the previous page (zero on the first page).
	after pageKey
	// size is how many items the page holds at most.
	size int
}

// openPage decodes a list request's page_token for method and resolves its
// page_size (checkPage has bounded both).
func openPage(method string, size int32, token string) (page, error) {
	after, err := decodePage(method, token)
	if err != nil {
		return page{}, err
	}
	return page{method: method, after: after, size: pageSize(size)}, nil
}

// limit is the row count to ask the query for: one more than the page, so
// a further page is known to exist without counting.
func (p page) limit() int { return p.size + 1 }

// collectPage reads a page of items from rows, which must be in keyset
// order and hold at most p.limit() rows; scan decodes one row into its item
// and its keyset key. It returns the items and the next page's token, ""
// when this page is the last. It closes rows.
func collectPage[T any](p page, rows pgx.Rows, scan func(pgx.Rows) (T, pageKey, error)) ([]T, string, error) {
	return collectPageWithin(p, rows, scan, nil, 0)
}

// collectPageWithin is collectPage with a budget: a page also ends, with a
// next page token, before the item whose weight would take the page's total
// past maxWeight. The first item of a page is always taken.
func collectPageWithin[T any](p page, rows pgx.Rows, scan func(pgx.Rows) (T, pageKey, error), weigh func(T) int, maxWeight int) ([]T, string, error) {
	defer rows.Close()
	var (
		items  []T
		last   pageKey
		weight int
	)
	for rows.Next() {
		item, key, err := scan(rows)
		if err != nil {
			return nil, "", err
		}
		w := 0
		if weigh != nil {
			w = weigh(item)
		}
		if n := len(items); n == p.size || (n > 0 && weigh != nil && weight+w > maxWeight) {
			last.Method = p.method
			return items, encodePage(last), nil
		}
		items = append(items, item)
		last, weight = key, weight+w
	}
	return items, "", rows.Err()
}
