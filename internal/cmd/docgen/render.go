package main

import (
	"fmt"
	"regexp"
	"sort"
	"strings"

	"github.com/outboxrelay/outboxrelay/internal/cli"
)

// render is the page for the binaries' settings and the job spec's keys.
// It depends on nothing but its arguments, so the same settings always
// give the same bytes.
func render(bins []cli.Binary, spec []specField) string {
	var w strings.Builder
	p := func(format string, args ...any) { fmt.Fprintf(&w, format, args...) }
	p("# Configuration reference\n\n")
	p("<!-- Generated from the binaries' own settings by %s. Do not edit: change the setting in the code and regenerate. -->\n\n", regenerate)
	p("Every setting of the three binaries, per sub-command, as `<binary> <command> --help` prints it.\n")
	p("A setting is a flag or an environment variable; when both are given, the flag wins. A setting\n")
	p("without a variable (—) is a flag only.\n\n")
	p("**Secrets** (marked *secret*) are never printed and are masked in logs and errors. Give them as\n")
	p("environment variables or files, not as flags: a flag is visible to every local user (`ps`), and\n")
	p("the binary warns. A connection string's `*_FILE` variable names a file that holds it (a Docker or\n")
	p("Kubernetes secret); surrounding whitespace is dropped, and setting both forms is an error. A file\n")
	p("holding a secret should be readable by its owner only (mode 0600 or 0400); otherwise the binary\n")
	p("warns.\n\n")
	p("**Tracing** uses OpenTelemetry's standard variables, which are not flags: it is on when\n")
	p("`OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, over\n")
	p("`http/protobuf` only; `OTEL_SDK_DISABLED=true` turns it off; `OTEL_SERVICE_NAME` and\n")
	p("`OTEL_RESOURCE_ATTRIBUTES` name the service (default: the binary's name).\n\n")
	p("The keys of a job spec file (`batcher run --spec`) are listed at the end, in\n")
	p("[Job spec keys](#job-spec-keys).\n\n")
	p("## Contents\n\n")
	p("- [Environment variables](#environment-variables): every variable and the commands that read it\n")
	for _, b := range bins {
		var links []string
		for _, c := range b.Commands {
			links = append(links, fmt.Sprintf("[%s](#%s)", c.Name, anchor(b.Name+" "+c.Name)))
		}
		p("- [%s](#%s): %s\n", b.Name, anchor(b.Name), strings.Join(links, " · "))
	}
	if len(spec) > 0 {
		p("- [Job spec keys](#job-spec-keys): every key of a job spec file\n")
	}
	p("\n")
	renderEnvIndex(&w, bins)
	for _, b := range bins {
		p("## %s\n\n", b.Name)
		p("`%s` %s.\n\n", b.Name, inline(b.About))
		for _, c := range b.Commands {
			p("### %s %s\n\n", b.Name, c.Name)
			p("%s.\n\n", upperFirst(inline(c.Summary)))
			renderSynopsis(&w, c.Synopsis)
			if len(c.Settings) == 0 {
				p("No settings.\n\n")
				continue
			}
			p("| Flag | Variable | Type | Default | Description |\n")
			p("|---|---|---|---|---|\n")
			for _, s := range c.Settings {
				p("| `--%s` | %s | %s | %s | %s |\n", s.Flag, envCell(s.Env), s.Kind, defaultCell(s), description(s, c.Settings))
			}
			p("\n")
		}
	}
	if len(spec) > 0 {
		renderSpec(&w, spec)
	}
	return strings.TrimRight(w.String(), "\n") + "\n"
}

// renderEnvIndex is the table of every variable: its flag and the commands
// that read it ("every command" of a binary when all of them do).
func renderEnvIndex(w *strings.Builder, bins []cli.Binary) {
	type use struct {
		flags map[string]bool
		cmds  map[string][]string // binary → commands
	}
	uses := map[string]*use{}
	for _, b := range bins {
		for _, c := range b.Commands {
			for _, s := range c.Settings {
				if s.Env == "" {
					continue
				}
				u := uses[s.Env]
				if u == nil {
					u = &use{flags: map[string]bool{}, cmds: map[string][]string{}}
					uses[s.Env] = u
				}
				u.flags["`--"+s.Flag+"`"] = true
				u.cmds[b.Name] = append(u.cmds[b.Name], c.Name)
			}
		}
	}
	names := make([]string, 0, len(uses))
	for n := range uses {
		names = append(names, n)
	}
	sort.Strings(names)
	fmt.Fprintf(w, "## Environment variables\n\n")
	fmt.Fprintf(w, "| Variable | Flag | Read by |\n|---|---|---|\n")
	for _, n := range names {
		u := uses[n]
		var readers []string
		for _, b := range bins {
			cmds := u.cmds[b.Name]
			switch {
			case len(cmds) == 0:
			case len(cmds) == len(b.Commands):
				readers = append(readers, fmt.Sprintf("**%s** every command", b.Name))
			default:
				var links []string
				for _, c := range cmds {
					links = append(links, fmt.Sprintf("[%s](#%s)", c, anchor(b.Name+" "+c)))
				}
				readers = append(readers, fmt.Sprintf("**%s** %s", b.Name, strings.Join(links, ", ")))
			}
		}
		fmt.Fprintf(w, "| `%s` | %s | %s |\n", n, strings.Join(sortedKeys(u.flags), ", "), strings.Join(readers, "; "))
	}
	fmt.Fprintf(w, "\n")
}

func sortedKeys(m map[string]bool) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// renderSynopsis writes a command's synopsis: paragraphs of running text
// joined into lines, an indented paragraph (a file format, an example) as
// a text block as --help shows it.
func renderSynopsis(w *strings.Builder, synopsis string) {
	if synopsis == "" {
		return
	}
	for _, para := range strings.Split(strings.TrimSpace(synopsis), "\n\n") {
		lines := strings.Split(para, "\n")
		verbatim := false
		for _, l := range lines {
			if strings.HasPrefix(l, " ") || strings.HasPrefix(l, "\t") {
				verbatim = true
			}
		}
		if verbatim {
			fmt.Fprintf(w, "```text\n%s\n```\n\n", para)
			continue
		}
		fmt.Fprintf(w, "%s\n\n", inline(strings.Join(lines, " ")))
	}
}

func envCell(env string) string {
	if env == "" {
		return "—"
	}
	return "`" + env + "`"
}

func defaultCell(s cli.DescribedSetting) string {
	if s.Default == "" {
		return "*empty*"
	}
	return "`" + s.Default + "`"
}

// description is the setting's help, and what kind of secret it is.
// all are the settings of its command (for the name of a *_FILE form).
func description(s cli.DescribedSetting, all []cli.DescribedSetting) string {
	d := cell(s.Usage)
	note := ""
	switch {
	case s.Secret && s.FileFlag != "":
		file := "--" + s.FileFlag
		for _, o := range all {
			if o.Flag == s.FileFlag && o.Env != "" {
				file = o.Env
			}
		}
		note = fmt.Sprintf("*Secret*; or from a file: `%s`.", file)
	case s.Secret:
		note = "*Secret*."
	case s.SecretFile:
		note = "A file holding a secret: mode 0600 or 0400."
	}
	if note == "" {
		return d
	}
	if !strings.HasSuffix(d, ".") {
		d += "."
	}
	return d + " " + note
}

// cell is text in a table cell: one line, pipes escaped.
func cell(s string) string {
	return strings.ReplaceAll(inline(strings.Join(strings.Fields(s), " ")), "|", `\|`)
}

// inline escapes what Markdown would read as HTML or emphasis outside
// code spans: <, >, * and a word's leading _ (as in "_id"; one inside a
// word, as in DATABASE_URL, is no emphasis).
func inline(s string) string {
	parts := strings.Split(s, "`")
	for i := 0; i < len(parts); i += 2 { // even parts are outside code spans
		parts[i] = strings.NewReplacer("<", "&lt;", ">", "&gt;", "*", `\*`).Replace(parts[i])
		parts[i] = leadingUnderscoreRE.ReplaceAllString(parts[i], `$1\_`)
	}
	return strings.Join(parts, "`")
}

var leadingUnderscoreRE = regexp.MustCompile(`(^|[\s("'])_`)

func upperFirst(s string) string {
	if s == "" {
		return s
	}
	return strings.ToUpper(s[:1]) + s[1:]
}

// anchor is the id GitHub gives a heading: lower case, punctuation other
// than '-' and '_' dropped, spaces as '-'.
func anchor(heading string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(heading) {
		switch {
		case r == ' ':
			b.WriteByte('-')
		case r == '-' || r == '_' || r >= 'a' && r <= 'z' || r >= '0' && r <= '9':
			b.WriteRune(r)
		}
	}
	return b.String()
}
