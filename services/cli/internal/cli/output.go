package cli

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"
	"gopkg.in/yaml.v3"
)

// Output formats of -o.
const (
	formatTable = "table"
	formatWide  = "wide"
	formatJSON  = "json"
	formatYAML  = "yaml"
)

var formats = []string{formatTable, formatWide, formatJSON, formatYAML}

func checkFormat(f string) error {
	for _, ok := range formats {
		if f == ok {
			return nil
		}
	}
	return usagef("-o/--output: unknown format %q (want one of %s)", f, strings.Join(formats, ", "))
}

// structured reports whether the format prints messages, not tables.
func structured(f string) bool { return f == formatJSON || f == formatYAML }

// marshalJSON is the protobuf JSON of m (lowerCamelCase names, enums by
// name), indented by two spaces with a stable layout.
func marshalJSON(m proto.Message) ([]byte, error) {
	b, err := protojson.Marshal(m)
	if err != nil {
		return nil, fmt.Errorf("encode %s as JSON: %w", m.ProtoReflect().Descriptor().FullName(), err)
	}
	// protojson's spacing is deliberately unstable: re-indent it.
	var out bytes.Buffer
	if err := json.Indent(&out, b, "", "  "); err != nil {
		return nil, fmt.Errorf("indent JSON: %w", err)
	}
	out.WriteByte('\n')
	return out.Bytes(), nil
}

// marshalYAML is the same document as marshalJSON, in YAML block style.
func marshalYAML(m proto.Message) ([]byte, error) {
	b, err := marshalJSON(m)
	if err != nil {
		return nil, err
	}
	var doc yaml.Node
	if err := yaml.Unmarshal(b, &doc); err != nil {
		return nil, fmt.Errorf("convert JSON to YAML: %w", err)
	}
	blockStyle(&doc)
	var out bytes.Buffer
	enc := yaml.NewEncoder(&out)
	enc.SetIndent(2)
	if err := enc.Encode(&doc); err != nil {
		return nil, fmt.Errorf("encode YAML: %w", err)
	}
	_ = enc.Close()
	return out.Bytes(), nil
}

// blockStyle clears the flow style JSON gave every node, so scalars are
// quoted only where YAML needs it.
func blockStyle(n *yaml.Node) {
	n.Style = 0
	for _, c := range n.Content {
		blockStyle(c)
	}
}

// printMessage writes m in the structured format f.
func printMessage(w io.Writer, f string, m proto.Message) error {
	var b []byte
	var err error
	if f == formatYAML {
		b, err = marshalYAML(m)
	} else {
		b, err = marshalJSON(m)
	}
	if err != nil {
		return err
	}
	_, err = w.Write(b)
	return err
}

// table writes rows under a header, aligned.
type table struct {
	tw *tabwriter.Writer
}

func newTable(w io.Writer, header ...string) *table {
	t := &table{tw: tabwriter.NewWriter(w, 0, 4, 3, ' ', 0)}
	if len(header) > 0 {
		t.row(header...)
	}
	return t
}

func (t *table) row(cols ...string) {
	for i, c := range cols {
		if c == "" {
			cols[i] = "-"
		}
	}
	_, _ = fmt.Fprintln(t.tw, strings.Join(cols, "\t"))
}

func (t *table) flush() error { return t.tw.Flush() }

// age is how long ago ts was, kubectl-style (45s, 3m, 5h, 2d); "-" when unset.
func age(now time.Time, ts *timestamppb.Timestamp) string {
	if ts == nil {
		return "-"
	}
	return humanDuration(now.Sub(ts.AsTime()))
}

// until is how long until ts, or "expired" when it passed.
func until(now time.Time, ts *timestamppb.Timestamp) string {
	if ts == nil {
		return "-"
	}
	d := ts.AsTime().Sub(now)
	if d <= 0 {
		return "expired"
	}
	return "in " + humanDuration(d)
}

func humanDuration(d time.Duration) string {
	if d < 0 {
		d = 0
	}
	switch {
	case d < time.Minute:
		return fmt.Sprintf("%ds", int(d.Seconds()))
	case d < time.Hour:
		return fmt.Sprintf("%dm", int(d.Minutes()))
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh", int(d.Hours()))
	}
	return fmt.Sprintf("%dd", int(d.Hours()/24))
}

// timestamp is ts in RFC 3339 UTC, "-" when unset.
func timestamp(ts *timestamppb.Timestamp) string {
	if ts == nil {
		return "-"
	}
	return ts.AsTime().UTC().Format(time.RFC3339)
}

func durationString(d *durationpb.Duration) string {
	if d == nil {
		return "-"
	}
	return d.AsDuration().String()
}

// labelString is k=v,k=v sorted by key.
func labelString(m map[string]string) string {
	if len(m) == 0 {
		return "-"
	}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = k + "=" + m[k]
	}
	return strings.Join(parts, ",")
}

// enumName is an enum's name without its type prefix, lower-cased:
// NODE_STATE_CONNECTED -> connected.
func enumName(full, prefix string) string {
	return strings.ToLower(strings.TrimPrefix(full, prefix))
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}
