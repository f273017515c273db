package selector_test

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/pkg/pgtest"
	"github.com/leasehold/leasehold/pkg/selector"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

var labels = map[string]string{"env": "prod", "zone": "a", "gpu": "", "tier": "web"}

func TestParseAndMatch(t *testing.T) {
	t.Parallel()
	cases := []struct {
		in    string
		match bool
		canon string
	}{
		{"", true, ""},
		{"   ", true, ""},
		{"env=prod", true, "env=prod"},
		{"env==prod", true, "env=prod"},
		{" env = prod ", true, "env=prod"},
		{"env!=prod", false, "env!=prod"},
		{"missing!=x", true, "missing!=x"},
		{"env in (prod,dev)", true, "env in (prod,dev)"},
		{"env in ( dev , test )", false, "env in (dev,test)"},
		{"env notin (dev)", true, "env!=dev"},
		{"missing notin (a,b)", true, "missing notin (a,b)"},
		{"env notin (prod,dev)", false, "env notin (prod,dev)"},
		{"gpu", true, "gpu"},
		{"!gpu", false, "!gpu"},
		{"!missing", true, "!missing"},
		{"missing", false, "missing"},
		{"gpu=", true, "gpu="},
		{"env=prod,zone in (a,b),!missing,tier", true, "env=prod,zone in (a,b),!missing,tier"},
		{"env=prod,zone=b", false, "env=prod,zone=b"},
		{"example.com/role=web", false, "example.com/role=web"},
	}
	for _, c := range cases {
		t.Run(c.in, func(t *testing.T) {
			s, err := selector.Parse(c.in)
			require.NoError(t, err)
			require.Equal(t, c.match, s.Matches(labels))
			require.Equal(t, c.canon, s.String())
			again, err := selector.Parse(s.String())
			require.NoError(t, err)
			require.Equal(t, s, again)
		})
	}
}

func TestParseErrors(t *testing.T) {
	t.Parallel()
	cases := []struct {
		in  string
		pos int
		msg string
	}{
		{"env=prod,", 9, "expected a requirement after ','"},
		{",env", 0, "expected a label key"},
		{"env=prod zone=a", 9, "expected ',' between requirements"},
		{"env in prod", 7, "expected '('"},
		{"env in (a,b", 11, "expected ',' or ')'"},
		{"env in ()", 8, "expected a value in the set"},
		{"env in (a,,b)", 10, "expected a value in the set"},
		{"env ~ prod", 4, "expected an operator"},
		{"env like prod", 4, `found "like"`},
		{"-env=prod", 0, "key \"-env\" must match"},
		{"!", 1, "expected a label key, found the end"},
		{"!=x", 1, "expected a label key"},
		{"env===x", 5, "expected ',' between requirements"},
		{"env=(x)", 4, "expected ',' between requirements"},
	}
	for _, c := range cases {
		t.Run(c.in, func(t *testing.T) {
			_, err := selector.Parse(c.in)
			require.Error(t, err)
			var se *selector.SyntaxError
			require.True(t, errors.As(err, &se), "%T", err)
			require.Equal(t, c.pos, se.Pos, err.Error())
			require.Contains(t, err.Error(), c.msg)
		})
	}
}

// TestSQLAgrees evaluates selectors in PostgreSQL over jsonb labels and
// checks the answer is Matches'.
func TestSQLAgrees(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	sets := []map[string]string{labels, {}, {"env": "dev"}, {"env": "prod", "gpu": "1", "zone": "b"}}
	sels := []string{"", "env=prod", "env!=prod", "env in (prod,dev)", "env notin (prod)", "gpu", "!gpu",
		"env=prod,zone in (a,b),!missing", "gpu=", "zone notin (a,b),env"}
	for _, ls := range sets {
		for _, in := range sels {
			s, err := selector.Parse(in)
			require.NoError(t, err)
			var got bool
			require.NoError(t, db.QueryRow(ctx, `SELECT `+selector.SQLCondition("$1::jsonb", "$2"),
				mustJSON(t, ls), s.SQLArg()).Scan(&got))
			require.Equal(t, s.Matches(ls), got, "selector %q labels %v", in, ls)
		}
	}
}

func mustJSON(t *testing.T, m map[string]string) string {
	t.Helper()
	s := "{"
	first := true
	for k, v := range m {
		if !first {
			s += ","
		}
		first = false
		s += `"` + k + `":"` + v + `"`
	}
	return s + "}"
}

// FuzzParse: Parse never panics, and a selector it accepts prints to a
// string that parses back to the same selector.
func FuzzParse(f *testing.F) {
	for _, s := range []string{"", "env=prod", "a in (b,c),!d,e!=f", "k notin (x)", "x==y", "!", "a in (", "a=b,,"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in string) {
		s, err := selector.Parse(in)
		if err != nil {
			var se *selector.SyntaxError
			require.True(t, errors.As(err, &se))
			require.GreaterOrEqual(t, se.Pos, 0)
			return
		}
		again, err := selector.Parse(s.String())
		require.NoError(t, err, "canonical %q of %q", s.String(), in)
		require.Equal(t, s, again)
	})
}
