package docs

import (
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
)

// runnableMarker marks a page whose `sh` blocks TestRunnableDocs runs.
const runnableMarker = "<!-- runnable -->"

// page is a Markdown file split into what the tests need.
type page struct {
	path     string // as named in failures, relative to the repository root
	lines    []string
	runnable bool
	blocks   []block
}

// block is a fenced code block.
type block struct {
	info  string   // the info string, trimmed
	line  int      // 1-based line of the first content line
	lines []string // content, the fence's indentation removed
}

var fenceRE = regexp.MustCompile("^( {0,3})(`{3,}|~{3,})(.*)$")

// parsePage reads a Markdown page. rel is its name in failures.
func parsePage(path, rel string) (page, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return page{}, err
	}
	p := page{path: rel, lines: strings.Split(strings.TrimSuffix(string(b), "\n"), "\n")}
	var open *block
	var fence string
	var indent int
	for i, l := range p.lines {
		if open != nil {
			t := strings.TrimLeft(l, " ")
			if strings.HasPrefix(t, fence) && strings.Trim(t, fence[:1]+" \t") == "" {
				p.blocks = append(p.blocks, *open)
				open = nil
				continue
			}
			open.lines = append(open.lines, dropIndent(l, indent))
			continue
		}
		if m := fenceRE.FindStringSubmatch(l); m != nil && !(m[2][0] == '`' && strings.Contains(m[3], "`")) {
			fence, indent = m[2], len(m[1])
			open = &block{info: strings.TrimSpace(m[3]), line: i + 2}
			continue
		}
		if strings.TrimSpace(l) == runnableMarker {
			p.runnable = true
		}
	}
	if open != nil {
		return p, fmt.Errorf("%s:%d: code block not closed", rel, open.line-1)
	}
	return p, nil
}

func dropIndent(l string, n int) string {
	for ; n > 0 && strings.HasPrefix(l, " "); n-- {
		l = l[1:]
	}
	return l
}

// pages are README.md and the pages under docs/ (testdata left out): the
// pages that may be runnable.
func pages(root string) ([]page, error) {
	files := []string{filepath.Join(root, "README.md")}
	err := filepath.WalkDir(filepath.Join(root, "docs"), func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && d.Name() == "testdata" {
			return filepath.SkipDir
		}
		if !d.IsDir() && strings.HasSuffix(path, ".md") {
			files = append(files, path)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return parsePages(root, files)
}

// allPages are every Markdown file of the repository (testdata, hidden
// directories and node_modules left out): the pages whose links are
// checked.
func allPages(root string) ([]page, error) {
	var files []string
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && path != root && (d.Name() == "testdata" || d.Name() == "node_modules" || strings.HasPrefix(d.Name(), ".")) {
			return filepath.SkipDir
		}
		if !d.IsDir() && strings.HasSuffix(path, ".md") {
			files = append(files, path)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return parsePages(root, files)
}

func parsePages(root string, files []string) ([]page, error) {
	var out []page
	for _, f := range files {
		rel, err := filepath.Rel(root, f)
		if err != nil {
			return nil, err
		}
		p, err := parsePage(f, filepath.ToSlash(rel))
		if err != nil {
			return nil, err
		}
		out = append(out, p)
	}
	return out, nil
}

// anchors are the ids GitHub gives the page's headings (a repeated heading
// gets -1, -2, …), plus those of explicit <a name|id="…"> tags.
func (p page) anchors() map[string]bool {
	out := map[string]bool{}
	seen := map[string]int{}
	inCode := map[int]bool{}
	for _, b := range p.blocks {
		for i := b.line - 1; i <= b.line+len(b.lines); i++ {
			inCode[i] = true // the fences and the content (1-based)
		}
	}
	for i, l := range p.lines {
		for _, m := range htmlAnchorRE.FindAllStringSubmatch(l, -1) {
			out[m[1]] = true
		}
		if inCode[i+1] {
			continue
		}
		m := headingRE.FindStringSubmatch(l)
		if m == nil {
			continue
		}
		a := githubAnchor(m[1])
		if n := seen[a]; n > 0 {
			out[fmt.Sprintf("%s-%d", a, n)] = true
		} else {
			out[a] = true
		}
		seen[a]++
	}
	return out
}

var (
	headingRE    = regexp.MustCompile(`^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$`)
	htmlAnchorRE = regexp.MustCompile(`<a\s+(?:name|id)="([^"]+)"`)
	mdLinkRE     = regexp.MustCompile(`\[([^\]]*)\]\(([^)\s]+)(?:\s+"[^"]*")?\)`)
	imageOrLink  = regexp.MustCompile(`!?\[([^\]]*)\]\([^)]*\)`)
)

// githubAnchor is the id GitHub gives a heading: its text as rendered
// (links by their text, code spans and emphasis marks dropped), lower
// case, every character other than letters, digits, '-', '_' and space
// dropped, spaces as '-'.
func githubAnchor(heading string) string {
	text := imageOrLink.ReplaceAllString(heading, "$1")
	var b strings.Builder
	for _, r := range strings.ToLower(text) {
		switch {
		case r == ' ':
			b.WriteByte('-')
		case r == '-' || r == '_':
			b.WriteRune(r)
		case r >= 'a' && r <= 'z' || r >= '0' && r <= '9':
			b.WriteRune(r)
		case r > 127 && (isLetter(r)):
			b.WriteRune(r)
		}
	}
	return b.String()
}

func isLetter(r rune) bool { return strings.ToUpper(string(r)) != strings.ToLower(string(r)) }

// link is a Markdown link of a page outside code.
type link struct {
	line   int
	target string
}

// links are the page's inline links and reference definitions, outside
// code blocks and code spans.
func (p page) links() []link {
	inCode := map[int]bool{}
	for _, b := range p.blocks {
		for i := b.line - 1; i <= b.line+len(b.lines); i++ {
			inCode[i] = true
		}
	}
	var out []link
	for i, l := range p.lines {
		if inCode[i+1] {
			continue
		}
		l = codeSpanRE.ReplaceAllString(l, "")
		for _, m := range mdLinkRE.FindAllStringSubmatch(l, -1) {
			out = append(out, link{line: i + 1, target: m[2]})
		}
		if m := refDefRE.FindStringSubmatch(l); m != nil {
			out = append(out, link{line: i + 1, target: m[1]})
		}
	}
	return out
}

var (
	codeSpanRE = regexp.MustCompile("`+[^`]*`+")
	refDefRE   = regexp.MustCompile(`^ {0,3}\[[^\]]+\]:\s+(\S+)`)
)

// checkLinks returns one line per broken relative link of the pages: a
// file that does not exist, or an anchor no heading of the target has.
// root is the repository, where the pages' paths start.
func checkLinks(root string, ps []page) []string {
	byPath := map[string]page{}
	for _, p := range ps {
		byPath[p.path] = p
	}
	var broken []string
	for _, p := range ps {
		for _, l := range p.links() {
			t := l.target
			if strings.Contains(t, "://") || strings.HasPrefix(t, "mailto:") || strings.HasPrefix(t, "<") {
				continue
			}
			file, frag, _ := strings.Cut(t, "#")
			target := p.path
			if file != "" {
				target = filepath.ToSlash(filepath.Clean(filepath.Join(filepath.Dir(p.path), file)))
			}
			where := fmt.Sprintf("%s:%d: (%s)", p.path, l.line, t)
			if strings.HasPrefix(target, "../") || filepath.IsAbs(file) {
				broken = append(broken, where+": points outside the repository")
				continue
			}
			if _, err := os.Stat(filepath.Join(root, target)); err != nil {
				broken = append(broken, fmt.Sprintf("%s: %s does not exist", where, target))
				continue
			}
			if frag == "" || !strings.HasSuffix(target, ".md") {
				continue
			}
			tp, ok := byPath[target]
			if !ok {
				var err error
				if tp, err = parsePage(filepath.Join(root, target), target); err != nil {
					broken = append(broken, fmt.Sprintf("%s: %v", where, err))
					continue
				}
				byPath[target] = tp
			}
			if !tp.anchors()[frag] {
				broken = append(broken, fmt.Sprintf("%s: %s has no heading with anchor #%s (it has: %s)", where, target, frag, strings.Join(sortedAnchors(tp), ", ")))
			}
		}
	}
	return broken
}

// sortedAnchors are the page's anchors for a failure, at most 30.
func sortedAnchors(p page) []string {
	var out []string
	for a := range p.anchors() {
		out = append(out, a)
	}
	sort.Strings(out)
	if len(out) > 30 {
		out = append(out[:30], "…")
	}
	return out
}
