package docs

import (
	"context"
	"fmt"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/cli"
	"github.com/outboxrelay/outboxrelay/internal/settingsread"
	"github.com/outboxrelay/outboxrelay/internal/stack"
)

// The `sh` blocks of the pages that are not run (README.md and the docs/
// pages without the runnable marker) are checked against the binaries:
// every batcher, publisher or indexer command they show exists with every
// flag it passes, and every UPPER_CASE variable they set is a setting one
// of the binaries reads (or in shellVarAllowlist). The truth is each
// binary's hidden settings command (cli.SettingsCommand), as for
// docs/configuration.md.
func TestShownCommandsExist(t *testing.T) {
	t.Parallel()
	root := stack.RepoRoot()
	ps, err := pages(root)
	require.NoError(t, err)
	bins := releaseSettings(t, root)
	var shown []page
	for _, p := range ps {
		if !p.runnable {
			shown = append(shown, p)
		}
	}
	require.NotEmpty(t, shown)
	if bad := checkCommands(shown, bins); len(bad) > 0 {
		t.Fatalf("%d unknown command(s), flag(s) or setting(s) in the docs:\n%s", len(bad), strings.Join(bad, "\n"))
	}
}

// The check names the page, the line and what is unknown: a misspelt
// flag, a sub-command that does not exist, a variable no binary reads.
func TestCommandCheckFindsUnknownFlagsAndSettings(t *testing.T) {
	t.Parallel()
	bins := releaseSettings(t, stack.RepoRoot())
	bad := checkCommands([]page{fixture(t, "commands.md")}, bins)
	require.Equal(t, []string{
		"docs/testdata/commands.md:14: batcher run: unknown flag --spek",
		"docs/testdata/commands.md:15: indexer: unknown command \"cutover-now\"",
		"docs/testdata/commands.md:16: KAFKA_TLS_CA: no binary reads this setting",
		"docs/testdata/commands.md:17: publisher topics ensure: unknown flag --partition",
		"docs/testdata/commands.md:18: TOPIK: no binary reads this setting",
		"docs/testdata/commands.md:18: indexer run: unknown flag --aliass",
		"docs/testdata/commands.md:28: batcher follow-trigger: unknown flag --instal",
	}, bad)
}

// releaseSettings are the settings of the release binaries.
func releaseSettings(t *testing.T, root string) []cli.Binary {
	t.Helper()
	dir, err := releaseBinaries(root)
	require.NoError(t, err)
	var out []cli.Binary
	for _, name := range []string{"batcher", "publisher", "indexer"} {
		b, err := settingsread.Read(context.Background(), filepath.Join(dir, name))
		require.NoError(t, err)
		out = append(out, b)
	}
	return out
}

// shellVarAllowlist are UPPER_CASE variables a page may set that are no
// binary's setting.
var shellVarAllowlist = map[string]bool{"PATH": true, "DOCS_RUN_ID": true}

var upperVarRE = regexp.MustCompile(`^[A-Z][A-Z0-9_]*$`)

// checkCommands returns one line per unknown thing in the pages' `sh`
// blocks: page:line: what.
func checkCommands(ps []page, bins []cli.Binary) []string {
	byName := map[string]cli.Binary{}
	envs := map[string]bool{}
	for _, b := range bins {
		byName[b.Name] = b
		for _, c := range b.Commands {
			for _, s := range c.Settings {
				if s.Env != "" {
					envs[s.Env] = true
				}
			}
		}
	}
	var bad []string
	for _, p := range ps {
		for _, b := range p.blocks {
			if b.info != "sh" && b.info != "sh background" {
				continue
			}
			for _, c := range shellCommands(b) {
				where := fmt.Sprintf("%s:%d", p.path, c.line)
				words := c.words
				if len(words) > 0 && (words[0] == "export" || words[0] == "env") {
					words = words[1:]
				}
				for len(words) > 0 {
					name, _, isAssign := strings.Cut(words[0], "=")
					if !isAssign && !(c.words[0] == "export" && upperVarRE.MatchString(name)) {
						break
					}
					if upperVarRE.MatchString(name) && !envs[name] && !shellVarAllowlist[name] {
						bad = append(bad, fmt.Sprintf("%s: %s: no binary reads this setting", where, name))
					}
					words = words[1:]
				}
				if len(words) == 0 {
					continue
				}
				bin, ok := byName[filepath.Base(words[0])]
				if !ok {
					continue
				}
				bad = append(bad, checkInvocation(where, bin, words[1:])...)
			}
		}
	}
	return bad
}

// checkInvocation checks `bin args…`: the sub-command exists (the longest
// command name its leading words spell) and so does every flag.
func checkInvocation(where string, bin cli.Binary, args []string) []string {
	if len(args) == 0 || strings.HasPrefix(args[0], "-") {
		return nil // the binary's usage
	}
	var cmd *cli.DescribedCommand
	n := 0
	for i, c := range bin.Commands {
		parts := strings.Fields(c.Name)
		if len(parts) > n && len(parts) <= len(args) && strings.Join(args[:len(parts)], " ") == c.Name {
			cmd, n = &bin.Commands[i], len(parts)
		}
	}
	if cmd == nil {
		return []string{fmt.Sprintf("%s: %s: unknown command %q", where, bin.Name, args[0])}
	}
	flags := map[string]bool{"help": true, "h": true}
	for _, s := range cmd.Settings {
		flags[s.Flag] = true
	}
	var bad []string
	for _, a := range args[n:] {
		if a == "--" {
			break
		}
		if !strings.HasPrefix(a, "-") || a == "-" {
			continue
		}
		name, _, _ := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if !flags[name] {
			bad = append(bad, fmt.Sprintf("%s: %s %s: unknown flag --%s", where, bin.Name, cmd.Name, name))
		}
	}
	return bad
}

// shellCommand is one simple command of a block: its words (quotes
// removed) and the page line it starts on.
type shellCommand struct {
	line  int
	words []string
}

// shellCommands splits a block into simple commands: lines joined at a
// trailing backslash, here-document bodies skipped, comments dropped,
// split at |, ||, &&, ; and &. Words are split at blanks outside quotes;
// $(…) stays inside its word. It is enough for the commands the pages
// show, not a shell.
func shellCommands(b block) []shellCommand {
	var out []shellCommand
	var heredoc []string // delimiters of here-documents still to skip
	for i := 0; i < len(b.lines); i++ {
		if len(heredoc) > 0 {
			if strings.TrimLeft(b.lines[i], "\t") == heredoc[0] {
				heredoc = heredoc[1:]
			}
			continue
		}
		start := i
		line := b.lines[i]
		for strings.HasSuffix(line, `\`) && i+1 < len(b.lines) {
			i++
			line = strings.TrimSuffix(line, `\`) + " " + b.lines[i]
		}
		cmds, docs := splitShell(line)
		heredoc = append(heredoc, docs...)
		for _, w := range cmds {
			if len(w) > 0 {
				out = append(out, shellCommand{line: b.line + start, words: w})
			}
		}
	}
	return out
}

var heredocRE = regexp.MustCompile(`^<<-?\s*['"]?([A-Za-z_][A-Za-z0-9_]*)['"]?`)

// splitShell splits one logical line into commands of words and returns
// the delimiters of the here-documents it opens.
func splitShell(line string) (cmds [][]string, heredocs []string) {
	var words []string
	var w strings.Builder
	inWord := false
	flushWord := func() {
		if inWord {
			words = append(words, w.String())
		}
		w.Reset()
		inWord = false
	}
	flushCmd := func() {
		flushWord()
		cmds = append(cmds, words)
		words = nil
	}
	for i := 0; i < len(line); i++ {
		ch := line[i]
		switch {
		case ch == '\'':
			j := strings.IndexByte(line[i+1:], '\'')
			if j < 0 {
				j = len(line) - i - 1
			}
			w.WriteString(line[i+1 : i+1+j])
			inWord = true
			i += j + 1
		case ch == '"':
			j := i + 1
			for ; j < len(line) && line[j] != '"'; j++ {
				if line[j] == '\\' && j+1 < len(line) {
					j++
				}
			}
			w.WriteString(line[i+1 : min(j, len(line))])
			inWord = true
			i = j
		case ch == '$' && i+1 < len(line) && line[i+1] == '(':
			depth, j := 0, i+1
			for ; j < len(line); j++ {
				if line[j] == '(' {
					depth++
				} else if line[j] == ')' {
					if depth--; depth == 0 {
						break
					}
				}
			}
			w.WriteString(line[i:min(j+1, len(line))])
			inWord = true
			i = j
		case ch == '\\' && i+1 < len(line):
			w.WriteByte(line[i+1])
			inWord = true
			i++
		case ch == ' ' || ch == '\t':
			flushWord()
		case ch == '#' && !inWord:
			flushCmd()
			return cmds, heredocs
		case ch == '<' && strings.HasPrefix(line[i:], "<<") && !strings.HasPrefix(line[i:], "<<<"):
			flushWord()
			if m := heredocRE.FindStringSubmatch(line[i:]); m != nil {
				heredocs = append(heredocs, m[1])
				i += len(m[0]) - 1
			} else {
				i++
			}
		case ch == '|' || ch == ';' || ch == '&':
			if i+1 < len(line) && (line[i+1] == ch) {
				i++
			}
			flushCmd()
		default:
			w.WriteByte(ch)
			inWord = true
		}
	}
	flushCmd()
	return cmds, heredocs
}
