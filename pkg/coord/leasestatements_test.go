package coord_test

import (
	"errors"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// The leases table has one owner: pkg/coord. Outside it, no Go file other
// than a test writes or locks it, so every lease rule (the epoch rule, the
// fence and its strength, who may change owner) lives here. Precisely, no
// string constant of a non-test Go file outside pkg/coord, pkg/gen and
// migrations/ may hold:
//
//   - INSERT INTO leases, UPDATE leases or DELETE FROM leases;
//   - a statement that names leases in FROM or JOIN and takes a row lock
//     (FOR UPDATE, FOR NO KEY UPDATE, FOR SHARE, FOR KEY SHARE) without an
//     OF list, or with an OF list naming leases or its alias.
//
// Reading leases is allowed everywhere: doctor's findings, the api's and
// the cli's lease listings, and the liveness joins on gateway:<id> leases
// of the worker, the api and the benches read without locking. A string
// constant is one literal or a + chain of literals (the parts between
// literals read as a space). lockingLeaseAllowed names the files the rule
// knowingly leaves out.

// lockingLeaseAllowed: files outside pkg/coord that may write leases, and why.
var lockingLeaseAllowed = map[string]string{
	// Imported by doctor's tests only: it writes lease rows in the states
	// (expired, at a given epoch, on a dead member) the findings are about.
	"services/doctor/internal/fixture/fixture.go": "test fixture",
}

var (
	leaseWriteRE = regexp.MustCompile(`(?i)\b(?:insert\s+into|update|delete\s+from)\s+(?:only\s+)?(?:public\.)?"?leases"?\b`)
	// leaseFromRE finds leases in a FROM list or a JOIN, with its alias.
	leaseFromRE = regexp.MustCompile(`(?i)(?:\bfrom|\bjoin|,)\s+(?:only\s+)?(?:public\.)?"?leases"?\b(?:\s+(?:as\s+)?([a-z_][a-z0-9_]*))?`)
	// rowLockRE finds a locking clause and its OF list.
	rowLockRE = regexp.MustCompile(`(?i)\bfor\s+(?:no\s+key\s+update|key\s+share|update|share)\b(?:\s+of\s+((?:[a-z_"][a-z0-9_."]*)(?:\s*,\s*[a-z_"][a-z0-9_."]*)*))?`)
	// notAnAlias are the words that may follow a table name and are no alias.
	notAnAlias = []string{"where", "on", "using", "join", "left", "right", "inner", "full", "cross", "natural",
		"for", "order", "group", "limit", "returning", "set", "union", "except", "intersect", "having", "window", "offset", "fetch"}
)

// leaseStatementViolation returns why the SQL text s writes or locks the
// leases table, or "" when it does not.
func leaseStatementViolation(s string) string {
	if m := leaseWriteRE.FindString(s); m != "" {
		return "writes leases (" + strings.Join(strings.Fields(m), " ") + ")"
	}
	froms := leaseFromRE.FindAllStringSubmatch(s, -1)
	if len(froms) == 0 {
		return ""
	}
	names := []string{"leases"}
	for _, f := range froms {
		if a := strings.ToLower(f[1]); a != "" && !slices.Contains(notAnAlias, a) {
			names = append(names, a)
		}
	}
	for _, l := range rowLockRE.FindAllStringSubmatch(s, -1) {
		clause := strings.Join(strings.Fields(l[0]), " ")
		if l[1] == "" {
			return "locks leases (" + clause + ")"
		}
		for _, of := range strings.Split(l[1], ",") {
			of = strings.ToLower(strings.Trim(strings.TrimSpace(of), `"`))
			of = strings.TrimPrefix(of, "public.")
			if slices.Contains(names, of) {
				return "locks leases (" + clause + ")"
			}
		}
	}
	return ""
}

func TestLeaseStatementRule(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		sql       string
		violation bool
	}{
		// What the rule is about: the statements moved into pkg/coord.
		{`INSERT INTO leases (name) VALUES ($1) ON CONFLICT (name) DO NOTHING`, true},
		{`SELECT owner, epoch, GREATEST(expires_at, 'epoch'::timestamptz), compute_now() FROM leases WHERE name = $1 FOR UPDATE`, true},
		{`SELECT l.epoch FROM nodes n JOIN leases l ON l.name = 'site:' || n.site_id || ':boot'
		   WHERE n.id = $1 AND l.owner = $1 FOR SHARE OF l`, true},
		{`SELECT 1 FROM leases WHERE name = $1 FOR KEY SHARE`, true},
		{"update leases set owner = null", true},
		{`DELETE FROM public.leases WHERE name LIKE 'gateway:%'`, true},
		{`UPDATE ONLY "leases" SET expires_at = compute_now()`, true},
		{`SELECT 1 FROM nodes n, leases AS g WHERE g.name = n.id FOR NO KEY UPDATE OF n, g`, true},
		{`SELECT 1 FROM leases WHERE true FOR UPDATE SKIP LOCKED`, true},
		// Reads, and locks of other tables.
		{`SELECT name, owner, epoch FROM leases WHERE owner IS NOT NULL`, false},
		{`SELECT n.id FROM nodes n LEFT JOIN leases g ON g.name = 'gateway:' || n.id WHERE n.id = $1`, false},
		{`SELECT c.id FROM commands c JOIN leases l ON l.name = c.node_id WHERE true FOR UPDATE OF c SKIP LOCKED`, false},
		{`SELECT pool_id FROM pool_leases WHERE id = $1 FOR UPDATE`, false},
		{`UPDATE pool_leases SET state = 'released'`, false},
		{`INSERT INTO leases_archive (name) VALUES ($1)`, false},
		{`%d transactions held FOR KEY SHARE locks on leases longer than the lease TTL`, false},
	} {
		got := leaseStatementViolation(c.sql)
		require.Equal(t, c.violation, got != "", "%q: %q", c.sql, got)
	}
}

// TestLeaseStatementsStayInCoord walks the repository's Go files and fails
// for every string constant outside pkg/coord that writes or locks the
// leases table (the rule above). make lint runs it (check-lease-statements).
func TestLeaseStatementsStayInCoord(t *testing.T) {
	t.Parallel()
	root := repoRoot(t)
	var found []string
	checked := 0
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(root, path)
		if err != nil {
			return err
		}
		rel = filepath.ToSlash(rel)
		if d.IsDir() {
			name := d.Name()
			if rel != "." && (strings.HasPrefix(name, ".") || name == "node_modules" || name == "testdata" || name == "vendor") ||
				rel == "pkg/coord" || rel == "pkg/gen" || rel == "migrations" {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(rel, ".go") || strings.HasSuffix(rel, "_test.go") || lockingLeaseAllowed[rel] != "" {
			return nil
		}
		checked++
		for _, v := range leaseStatementsIn(t, path) {
			found = append(found, rel+":"+v)
		}
		return nil
	})
	require.NoError(t, err)
	require.Greater(t, checked, 100, "the walk found the repository's Go files")
	require.Empty(t, found, "statements that write or lock the leases table belong to pkg/coord (Ensure, LockForHandover, Take, Renew, Fence, FenceSiteBootSQL); read them there or add what is missing:\n%s",
		strings.Join(found, "\n"))
}

// leaseStatementsIn returns "line: why" for each string constant of the Go
// file at path that breaks the rule.
func leaseStatementsIn(t *testing.T, path string) []string {
	t.Helper()
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
	require.NoError(t, err, path)
	var out []string
	seen := map[*ast.BasicLit]bool{}
	ast.Inspect(f, func(n ast.Node) bool {
		e, ok := n.(ast.Expr)
		if !ok {
			return true
		}
		s, lits, ok := stringConstant(e)
		if !ok || !slices.ContainsFunc(lits, func(l *ast.BasicLit) bool { return !seen[l] }) {
			return true // not a string constant, or a part of one already read
		}
		for _, l := range lits {
			seen[l] = true
		}
		if v := leaseStatementViolation(s); v != "" {
			out = append(out, strconv.Itoa(fset.Position(e.Pos()).Line)+": "+v)
		}
		return true // into the operands that are no literals (calls, ...)
	})
	return out
}

// stringConstant returns the text of a string literal, or of a + chain
// with at least one string literal (other operands read as a space), and
// the literals it is made of.
func stringConstant(e ast.Expr) (string, []*ast.BasicLit, bool) {
	switch e := e.(type) {
	case *ast.BasicLit:
		if e.Kind != token.STRING {
			return "", nil, false
		}
		s, err := strconv.Unquote(e.Value)
		return s, []*ast.BasicLit{e}, err == nil
	case *ast.ParenExpr:
		return stringConstant(e.X)
	case *ast.BinaryExpr:
		if e.Op != token.ADD {
			return "", nil, false
		}
		x, xl, xok := stringConstant(e.X)
		y, yl, yok := stringConstant(e.Y)
		if !xok && !yok {
			return "", nil, false
		}
		if !xok {
			x = " "
		}
		if !yok {
			y = " "
		}
		return x + y, append(xl, yl...), true
	}
	return "", nil, false
}

// repoRoot is the directory of go.work above the working directory.
func repoRoot(t *testing.T) string {
	t.Helper()
	dir, err := os.Getwd()
	require.NoError(t, err)
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.work")); err == nil {
			return dir
		} else if !errors.Is(err, fs.ErrNotExist) {
			require.NoError(t, err)
		}
		parent := filepath.Dir(dir)
		require.NotEqual(t, dir, parent, "no go.work above the working directory: the rule checks the whole repository")
		dir = parent
	}
}
