// Command doclinks checks that every relative link in the repository's
// Markdown files resolves: the file exists, and a #fragment names a heading
// of the Markdown file it points to (GitHub's anchor rules). It prints one
// line per broken link and exits 1 when there is any, so docs that name a
// page or a section that moved fail CI instead of rotting.
//
//	go run ./tools/doclinks [-root DIR]
package main

import (
	"bufio"
	"flag"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
)

func main() {
	root := flag.String("root", ".", "repository root (its git-tracked *.md files are checked)")
	flag.Parse()
	files, err := markdownFiles(*root)
	if err != nil {
		fmt.Fprintln(os.Stderr, "doclinks:", err)
		os.Exit(2)
	}
	broken, err := check(*root, files)
	if err != nil {
		fmt.Fprintln(os.Stderr, "doclinks:", err)
		os.Exit(2)
	}
	for _, b := range broken {
		fmt.Println(b)
	}
	if len(broken) > 0 {
		fmt.Fprintf(os.Stderr, "doclinks: %d broken links in %d files\n", len(broken), len(files))
		os.Exit(1)
	}
	fmt.Printf("doclinks: every relative link of %d Markdown files resolves\n", len(files))
}

// markdownFiles lists the git-tracked Markdown files under root, leaving
// out vendored and generated trees.
func markdownFiles(root string) ([]string, error) {
	out, err := exec.Command("git", "-C", root, "ls-files", "*.md").Output()
	if err != nil {
		return nil, fmt.Errorf("git ls-files: %w", err)
	}
	var files []string
	for _, f := range strings.Fields(string(out)) {
		if strings.Contains(f, "node_modules/") {
			continue
		}
		files = append(files, f)
	}
	return files, nil
}

var (
	fenceRE   = regexp.MustCompile("(?s)```.*?```")
	codeRE    = regexp.MustCompile("`[^`\n]*`")
	linkRE    = regexp.MustCompile(`\]\(([^)\s]+)\)`)
	schemeRE  = regexp.MustCompile(`^[A-Za-z][A-Za-z0-9+.-]*:`)
	headingRE = regexp.MustCompile(`^#{1,6}\s+(.*?)\s*#*\s*$`)
	dropRE    = regexp.MustCompile(`[^\p{L}\p{N}\- _]`)
)

// check returns "file: link: why" for every broken relative link of files.
func check(root string, files []string) ([]string, error) {
	anchors := map[string]map[string]bool{}
	var broken []string
	for _, f := range files {
		b, err := os.ReadFile(filepath.Join(root, f))
		if err != nil {
			return nil, err
		}
		text := codeRE.ReplaceAllString(fenceRE.ReplaceAllString(string(b), ""), "")
		for _, m := range linkRE.FindAllStringSubmatch(text, -1) {
			link := m[1]
			if schemeRE.MatchString(link) {
				continue
			}
			path, frag, _ := strings.Cut(link, "#")
			target := f
			if path != "" {
				target = filepath.Join(filepath.Dir(f), path)
			}
			if _, err := os.Stat(filepath.Join(root, target)); err != nil {
				broken = append(broken, fmt.Sprintf("%s: %s: no such file %s", f, link, target))
				continue
			}
			if frag == "" || !strings.HasSuffix(target, ".md") {
				continue
			}
			a, ok := anchors[target]
			if !ok {
				if a, err = headings(filepath.Join(root, target)); err != nil {
					return nil, err
				}
				anchors[target] = a
			}
			if !a[frag] {
				broken = append(broken, fmt.Sprintf("%s: %s: %s has no heading #%s", f, link, target, frag))
			}
		}
	}
	return broken, nil
}

// headings returns the anchors GitHub gives the headings of a Markdown
// file: lower case, punctuation other than hyphens and underscores
// dropped, spaces made hyphens, and -1, -2, … for repeats.
func headings(path string) (map[string]bool, error) {
	f, err := os.Open(path)
	if err != nil {
		if os.IsNotExist(err) {
			return nil, fs.ErrNotExist
		}
		return nil, err
	}
	defer f.Close()
	out := map[string]bool{}
	seen := map[string]int{}
	inFence := false
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(strings.TrimSpace(line), "```") {
			inFence = !inFence
			continue
		}
		m := headingRE.FindStringSubmatch(line)
		if inFence || m == nil {
			continue
		}
		a := Anchor(m[1])
		if n := seen[a]; n > 0 {
			out[fmt.Sprintf("%s-%d", a, n)] = true
		} else {
			out[a] = true
		}
		seen[a]++
	}
	return out, sc.Err()
}

// Anchor is the anchor GitHub derives from a heading's text.
func Anchor(heading string) string {
	h := strings.ToLower(strings.ReplaceAll(heading, "`", ""))
	h = dropRE.ReplaceAllString(h, "")
	return strings.ReplaceAll(h, " ", "-")
}
