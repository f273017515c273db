// Package sinks delivers node events to webhooks, one singleton:sink:<id>
// lease per configured sink. Each batch is a JSON POST signed with
// HMAC-SHA256 over "<timestamp>.<body>" with the sink's secret; a 2xx
// answer moves the saved cursor, anything else is retried with back-off.
// A new lease holder resumes from the saved cursor: at-least-once, and
// receivers deduplicate by event id.
package sinks

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leasehold/leasehold/pkg/reconcile"
)

// Header names of a delivery.
const (
	HeaderSignature = "X-Leasehold-Signature"
	HeaderTimestamp = "X-Leasehold-Timestamp"
	HeaderSink      = "X-Leasehold-Sink"
)

// Event is one delivered node event.
type Event struct {
	Seq        int64           `json:"seq"`
	NodeID     string          `json:"node_id"`
	ID         string          `json:"id"`
	Kind       string          `json:"kind"`
	Payload    json.RawMessage `json:"payload"`
	OccurredAt *time.Time      `json:"occurred_at,omitempty"`
	ReceivedAt time.Time       `json:"received_at"`
}

// Batch is the body of one POST.
type Batch struct {
	Sink   string  `json:"sink"`
	Events []Event `json:"events"`
}

// Sign returns the signature header value for body sent at ts.
func Sign(secret []byte, ts string, body []byte) string {
	m := hmac.New(sha256.New, secret)
	m.Write([]byte(ts))
	m.Write([]byte("."))
	m.Write(body)
	return "sha256=" + hex.EncodeToString(m.Sum(nil))
}

// Verify checks a delivery's signature in constant time.
func Verify(secret []byte, ts string, body []byte, signature string) bool {
	return hmac.Equal([]byte(Sign(secret, ts, body)), []byte(signature))
}

// Webhook is one configured sink.
type Webhook struct {
	ID     string
	URL    string
	Secret string
	Client *http.Client
}

const fetchSQL = `
SELECT txid::text::bigint, seq, node_id, id, kind, payload, occurred_at, received_at
  FROM node_events
 WHERE (txid, seq) > ($1::text::xid8, $2)
   AND txid < pg_snapshot_xmin(pg_current_snapshot())
 ORDER BY txid, seq
 LIMIT $3`

// Sink returns the runtime sink for w.
func (w Webhook) Sink() reconcile.Sink {
	return reconcile.Sink{ID: w.ID, Limit: 100, Idle: time.Second,
		Fetch: func(ctx context.Context, db *pgxpool.Pool, cur reconcile.Cursor, limit int) (any, reconcile.Cursor, int, error) {
			rows, err := db.Query(ctx, fetchSQL, strconv.FormatInt(cur.TxID, 10), cur.Seq, limit)
			if err != nil {
				return nil, cur, 0, fmt.Errorf("fetch events for sink %s: %w", w.ID, err)
			}
			defer rows.Close()
			b := Batch{Sink: w.ID}
			next := cur
			for rows.Next() {
				var e Event
				if err := rows.Scan(&next.TxID, &next.Seq, &e.NodeID, &e.ID, &e.Kind, &e.Payload, &e.OccurredAt, &e.ReceivedAt); err != nil {
					return nil, cur, 0, err
				}
				e.Seq = next.Seq
				b.Events = append(b.Events, e)
			}
			if err := rows.Err(); err != nil {
				return nil, cur, 0, err
			}
			return b, next, len(b.Events), nil
		},
		Deliver: func(ctx context.Context, batch any) error { return w.deliver(ctx, batch.(Batch)) },
	}
}

func (w Webhook) deliver(ctx context.Context, b Batch) error {
	body, err := json.Marshal(b)
	if err != nil {
		return err
	}
	ts := strconv.FormatInt(time.Now().Unix(), 10)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, w.URL, bytes.NewReader(body))
	if err != nil {
		return fmt.Errorf("sink %s: %w", w.ID, err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(HeaderTimestamp, ts)
	req.Header.Set(HeaderSink, w.ID)
	req.Header.Set(HeaderSignature, Sign([]byte(w.Secret), ts, body))
	client := w.Client
	if client == nil {
		client = &http.Client{Timeout: 10 * time.Second}
	}
	resp, err := client.Do(req)
	if err != nil {
		return fmt.Errorf("sink %s: post: %w", w.ID, err)
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("sink %s: receiver answered %s", w.ID, resp.Status)
	}
	return nil
}

// Load reads the configured sinks.
func Load(ctx context.Context, db *pgxpool.Pool) ([]Webhook, error) {
	rows, err := db.Query(ctx, "SELECT id, url, secret FROM sinks WHERE kind = 'webhook' ORDER BY id")
	if err != nil {
		return nil, fmt.Errorf("load sinks: %w", err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Webhook, error) {
		var w Webhook
		return w, r.Scan(&w.ID, &w.URL, &w.Secret)
	})
}
