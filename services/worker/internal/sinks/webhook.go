// Package sinks delivers node events to webhooks, one singleton:sink:<id>
// lease per configured sink. Each batch is a JSON POST signed as Standard
// Webhooks specify (webhook-id, webhook-timestamp, webhook-signature
// "v1,<base64 HMAC-SHA256 of id.timestamp.body>"), so receivers can verify
// it with an off-the-shelf library; the older X-Leasehold-Signature
// ("sha256=<hex HMAC-SHA256 of timestamp.body>") is still sent beside it. A
// 2xx answer moves the saved cursor, anything else is retried with
// back-off. A new lease holder resumes from the saved cursor:
// at-least-once, and receivers deduplicate by webhook-id or event id.
//
// Every connection goes through an egress.Policy (pkg/egress): a sink
// whose name resolves to loopback, link-local, metadata or (unless
// allowed) private addresses is refused when dialled, whatever it resolved
// to when it was created.
package sinks

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/leasehold/leasehold/pkg/egress"
	"github.com/leasehold/leasehold/pkg/reconcile"
)

// Header names of a delivery: the Standard Webhooks three, and
// leasehold's own (kept for receivers written against them).
const (
	HeaderID        = "webhook-id"
	HeaderTimestamp = "webhook-timestamp"
	HeaderSignature = "webhook-signature"

	HeaderLegacySignature = "X-Leasehold-Signature"
	HeaderLegacyTimestamp = "X-Leasehold-Timestamp"
	HeaderSink            = "X-Leasehold-Sink"
)

// SecretPrefix marks a Standard Webhooks secret: "whsec_" and the base64
// of the signing key.
const SecretPrefix = "whsec_"

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
	// ID is the message id sent as webhook-id: the same for every retry
	// of the same events, so receivers can drop a redelivery whole.
	ID     string  `json:"id"`
	Sink   string  `json:"sink"`
	Events []Event `json:"events"`
}

// SigningKey is the HMAC key of secret: the decoded key of a whsec_
// secret, otherwise the secret's own bytes. To verify with a Standard
// Webhooks library, give it a whsec_ secret as is, and any other secret as
// "whsec_" + base64(secret).
func SigningKey(secret string) []byte {
	if rest, ok := strings.CutPrefix(secret, SecretPrefix); ok {
		if key, err := base64.StdEncoding.DecodeString(rest); err == nil && len(key) > 0 {
			return key
		}
	}
	return []byte(secret)
}

// SignStandard returns the webhook-signature value of a delivery:
// "v1,<base64 HMAC-SHA256(key, id.timestamp.body)>".
func SignStandard(key []byte, id, ts string, body []byte) string {
	m := hmac.New(sha256.New, key)
	m.Write([]byte(id))
	m.Write([]byte("."))
	m.Write([]byte(ts))
	m.Write([]byte("."))
	m.Write(body)
	return "v1," + base64.StdEncoding.EncodeToString(m.Sum(nil))
}

// Sign returns the legacy X-Leasehold-Signature value for body sent at ts.
func Sign(secret []byte, ts string, body []byte) string {
	m := hmac.New(sha256.New, secret)
	m.Write([]byte(ts))
	m.Write([]byte("."))
	m.Write(body)
	return "sha256=" + hex.EncodeToString(m.Sum(nil))
}

// Verify checks a legacy X-Leasehold-Signature in constant time.
func Verify(secret []byte, ts string, body []byte, signature string) bool {
	return hmac.Equal([]byte(Sign(secret, ts, body)), []byte(signature))
}

// messageID names the events between two cursors of a sink: a retry of the
// same batch gets the same id.
func messageID(sink string, from, to reconcile.Cursor) string {
	h := sha256.New()
	h.Write([]byte(sink))
	for _, v := range []int64{from.TxID, from.Seq, to.TxID, to.Seq} {
		h.Write(binary.BigEndian.AppendUint64(nil, uint64(v)))
	}
	return "msg_" + hex.EncodeToString(h.Sum(nil)[:16])
}

// Webhook is one configured sink.
type Webhook struct {
	ID     string
	URL    string
	Secret string
	// Client posts the deliveries; Manager gives every sink one client
	// built from its egress.Policy.
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
			b.ID = messageID(w.ID, cur, next)
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
		// The parse error quotes the URL whole; say only that it is bad.
		return fmt.Errorf("sink %s: url %s does not parse", w.ID, egress.RedactURL(w.URL))
	}
	req.Header.Set("Content-Type", "application/json")
	// Set directly: the spec spells the names in lower case.
	req.Header[HeaderID] = []string{b.ID}
	req.Header[HeaderTimestamp] = []string{ts}
	req.Header[HeaderSignature] = []string{SignStandard(SigningKey(w.Secret), b.ID, ts, body)}
	req.Header.Set(HeaderLegacyTimestamp, ts)
	req.Header.Set(HeaderLegacySignature, Sign([]byte(w.Secret), ts, body))
	req.Header.Set(HeaderSink, w.ID)
	if w.Client == nil {
		return fmt.Errorf("sink %s: no HTTP client (the manager sets one with the egress policy)", w.ID)
	}
	resp, err := w.Client.Do(req)
	if err != nil {
		err = egress.RedactError(err)
		if errors.Is(err, egress.ErrRefused) {
			return fmt.Errorf("sink %s: %s refused: %w", w.ID, egress.RedactURL(w.URL), err)
		}
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
