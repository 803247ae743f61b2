// Package cli is the shared front of the three binaries: sub-command
// dispatch, settings that come from a flag or an environment variable (the
// flag wins), `--help` that shows both, and one clear line plus a non-zero
// exit code on error.
package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/outboxrelay/outboxrelay/internal/redact"
	"github.com/outboxrelay/outboxrelay/internal/tracing"
)

// Command is one sub-command of a binary.
type Command struct {
	Name    string
	Summary string
	// Run receives the arguments after the sub-command name.
	Run func(ctx context.Context, args []string) error
}

// ExitError carries a specific exit code (for example "conflict" = 3).
type ExitError struct {
	Code int
	Err  error
}

func (e *ExitError) Error() string { return e.Err.Error() }
func (e *ExitError) Unwrap() error { return e.Err }

// Exit codes shared by the binaries.
const (
	ExitOK       = 0
	ExitError1   = 1 // any failure
	ExitUsage    = 2 // bad flags, bad settings
	ExitConflict = 3 // the request conflicts with stored state; nothing changed
	ExitDrift    = 4 // a check found differences (e.g. reconcile without --repair)
)

// UsageError marks an error as the caller's (exit code 2).
func UsageError(format string, args ...any) error {
	return &ExitError{Code: ExitUsage, Err: fmt.Errorf(format, args...)}
}

// Main dispatches os.Args to commands and exits. about is printed at the top
// of the help.
func Main(ctx context.Context, binary, about string, commands []Command) {
	os.Exit(Dispatch(ctx, binary, about, commands, os.Args[1:], os.Stdout, os.Stderr))
}

// Dispatch is Main without the exit, for tests.
func Dispatch(ctx context.Context, binary, about string, commands []Command, args []string, stdout, stderr io.Writer) int {
	usage := func(w io.Writer) {
		fmt.Fprintf(w, "%s — %s\n\nUsage:\n  %s <command> [flags]\n\nCommands:\n", binary, about, binary)
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		for _, c := range commands {
			fmt.Fprintf(tw, "  %s\t%s\n", c.Name, c.Summary)
		}
		tw.Flush()
		fmt.Fprintf(w, "\nRun '%s <command> --help' for the settings of a command.\n", binary)
	}
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		if len(args) == 0 {
			usage(stderr)
			return ExitUsage
		}
		usage(stdout)
		return ExitOK
	}
	if args[0] == SettingsCommand {
		return writeSettings(ctx, binary, about, commands, stdout, stderr)
	}
	// Allow two-word commands such as "quarantine list".
	var cmd *Command
	var rest []string
	for i := range commands {
		words := strings.Fields(commands[i].Name)
		if len(args) >= len(words) && equalWords(args[:len(words)], words) {
			if cmd == nil || len(strings.Fields(cmd.Name)) < len(words) {
				cmd, rest = &commands[i], args[len(words):]
			}
		}
	}
	if cmd == nil {
		fmt.Fprintf(stderr, "%s: unknown command %q\n\n", binary, strings.Join(args, " "))
		usage(stderr)
		return ExitUsage
	}
	// Tracing is on only when OTEL_EXPORTER_OTLP_ENDPOINT says so; spans
	// still buffered are flushed before the exit.
	stopTracing, err := tracing.Setup(ctx, binary)
	if err != nil {
		fmt.Fprintf(stderr, "%s %s: %s\n", binary, cmd.Name, redact.String(err.Error()))
		return ExitUsage
	}
	err = cmd.Run(ctx, rest)
	// Warnings no logger has taken (a command that builds none).
	for _, w := range takeWarnings() {
		fmt.Fprintf(stderr, "%s %s: warning: %s\n", binary, cmd.Name, redact.String(w))
	}
	flushCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	_ = stopTracing(flushCtx) // an unreachable collector must not fail the command
	cancel()
	if err == nil {
		return ExitOK
	}
	if errors.Is(err, flag.ErrHelp) {
		return ExitOK
	}
	// The error may quote a secret (a driver's message, a setting's
	// value): every known secret value is masked.
	fmt.Fprintf(stderr, "%s %s: %s\n", binary, cmd.Name, redact.String(err.Error()))
	var ee *ExitError
	if errors.As(err, &ee) {
		return ee.Code
	}
	return ExitError1
}

func equalWords(a, b []string) bool {
	for i := range b {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// FlagSet binds settings to a flag and an environment variable each.
type FlagSet struct {
	fs       *flag.FlagSet
	name     string
	synopsis string
	settings []*setting
	lookup   func(string) (string, bool)
	// files are the *_FILE forms of secrets, read at the end of Parse.
	files []*secretFile
	// warnings are the warnings of the last Parse.
	warnings []string
	// requireTLS is REQUIRE_TLS, registered by the first RequireTLS call.
	requireTLS *bool
}

// RequireTLS registers --require-tls / REQUIRE_TLS on the first call and
// returns the same value to every caller: the Kafka, search engine and
// PostgreSQL settings of a command share the one setting.
func (f *FlagSet) RequireTLS() *bool {
	if f.requireTLS == nil {
		f.requireTLS = new(bool)
		f.Bool(f.requireTLS, "require-tls", "REQUIRE_TLS", false, "refuse any connection that does not verify its server: Kafka without KAFKA_TLS or with KAFKA_TLS_INSECURE_SKIP_VERIFY, an http:// ELASTICSEARCH_URL, a DATABASE_URL without sslmode=verify-full or verify-ca")
	}
	return f.requireTLS
}

type secretFile struct {
	dst       *string
	env, file string // ENV and the file named by ENV_FILE
}

type setting struct {
	flag, env, def, usage string
	want                  string // what a valid value looks like, for errors
	secret                bool
	// conn marks a secret that is a connection string (its passwords are
	// secret, not the whole string).
	conn bool
	// secretFile marks the name of a file holding a secret.
	secretFile bool
	value      *string // secret and secretFile settings
}

// NewFlagSet creates a set for "binary command"; synopsis is one line shown
// under the usage line.
func NewFlagSet(name, synopsis string) *FlagSet {
	f := &FlagSet{fs: flag.NewFlagSet(name, flag.ContinueOnError), name: name, synopsis: synopsis, lookup: os.LookupEnv}
	f.fs.SetOutput(io.Discard)
	return f
}

// SetLookupEnv replaces os.LookupEnv (tests).
func (f *FlagSet) SetLookupEnv(fn func(string) (string, bool)) { f.lookup = fn }

func (f *FlagSet) add(name, env, def, usage string) {
	f.settings = append(f.settings, &setting{flag: name, env: env, def: def, usage: usage, want: "a string"})
}

func (f *FlagSet) last(want string) { f.settings[len(f.settings)-1].want = want }

// String binds a string setting. env may be "" for flag-only settings.
func (f *FlagSet) String(p *string, name, env, def, usage string) {
	f.fs.StringVar(p, name, def, usage)
	f.add(name, env, def, usage)
}

// Secret is String whose value is never printed (defaults included). The
// value is registered with package redact, which masks it in every log line
// and error; given as a flag it is a warning (see [FlagSet.Warnings]).
func (f *FlagSet) Secret(p *string, name, env, def, usage string) {
	f.String(p, name, env, def, usage)
	s := f.settings[len(f.settings)-1]
	s.secret, s.value = true, p
}

// SecretFile is String for the name of a file that holds a secret (a
// password file, a private key) and that another package reads: a file its
// group or others may read is a warning, and its content is registered
// with package redact.
func (f *FlagSet) SecretFile(p *string, name, env, usage string) {
	f.String(p, name, env, "", usage)
	s := f.settings[len(f.settings)-1]
	s.secretFile, s.value = true, p
}

// SecretOrFile is Secret plus its file form, for connection strings:
// --NAME-file / ENV_FILE names a file (a Docker or Kubernetes secret) whose
// content, surrounding whitespace removed (a URL has none, and an editor's
// extra newline would make it unparsable), is the value. Setting both is
// an error.
func (f *FlagSet) SecretOrFile(p *string, name, env, usage string) {
	f.Secret(p, name, env, "", usage)
	f.settings[len(f.settings)-1].conn = true
	sf := &secretFile{dst: p, env: env}
	f.files = append(f.files, sf)
	fileEnv := ""
	if env != "" {
		fileEnv = env + "_FILE"
	}
	f.String(&sf.file, name+"-file", fileEnv, "", "file holding --"+name+" (instead of "+env+")")
	f.settings[len(f.settings)-1].secretFile = true
	f.settings[len(f.settings)-1].value = &sf.file
}

// Int binds an int setting.
func (f *FlagSet) Int(p *int, name, env string, def int, usage string) {
	f.fs.IntVar(p, name, def, usage)
	f.add(name, env, strconv.Itoa(def), usage)
	f.last("an integer")
}

// Int64 binds an int64 setting.
func (f *FlagSet) Int64(p *int64, name, env string, def int64, usage string) {
	f.fs.Int64Var(p, name, def, usage)
	f.add(name, env, strconv.FormatInt(def, 10), usage)
	f.last("an integer")
}

// Float binds a float64 setting.
func (f *FlagSet) Float(p *float64, name, env string, def float64, usage string) {
	f.fs.Float64Var(p, name, def, usage)
	f.add(name, env, strconv.FormatFloat(def, 'g', -1, 64), usage)
	f.last("a number")
}

// Bool binds a bool setting.
func (f *FlagSet) Bool(p *bool, name, env string, def bool, usage string) {
	f.fs.BoolVar(p, name, def, usage)
	f.add(name, env, strconv.FormatBool(def), usage)
	f.last("true or false")
}

// Duration binds a duration setting ("1.5s", "250ms").
func (f *FlagSet) Duration(p *time.Duration, name, env string, def time.Duration, usage string) {
	f.fs.DurationVar(p, name, def, usage)
	f.add(name, env, def.String(), usage)
	f.last("a duration such as 500ms or 1m30s")
}

// Parse applies environment variables, then flags. An environment variable
// that does not parse is an error naming the variable and its value.
func (f *FlagSet) Parse(args []string) ([]string, error) {
	f.warnings = nil
	if f.describeParse() {
		return nil, flag.ErrHelp
	}
	for _, s := range f.settings {
		if s.env == "" {
			continue
		}
		v, ok := f.lookup(s.env)
		if !ok {
			continue
		}
		if err := f.fs.Set(s.flag, v); err != nil {
			shown := v
			if s.secret {
				shown = "<redacted>"
			}
			return nil, UsageError("%s=%q: want %s", s.env, shown, s.want)
		}
	}
	if err := f.fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			f.PrintUsage(Stdout)
			return nil, flag.ErrHelp
		}
		return nil, UsageError("%v (see --help)", err)
	}
	f.registerSecrets(args[:len(args)-len(f.fs.Args())])
	for _, sf := range f.files {
		if sf.file == "" {
			continue
		}
		if *sf.dst != "" {
			return nil, UsageError("%s and %s_FILE are both set: set one", sf.env, sf.env)
		}
		b, err := os.ReadFile(sf.file)
		if err != nil {
			return nil, UsageError("%s_FILE=%q: %v", sf.env, sf.file, err)
		}
		v := strings.TrimSpace(string(b))
		if v == "" {
			return nil, UsageError("%s_FILE=%q: the file is empty", sf.env, sf.file)
		}
		*sf.dst = v
		redact.AddConnString(v)
	}
	addWarnings(f.warnings)
	return f.fs.Args(), nil
}

// PrintUsage writes the synopsis and every setting with its flag, variable
// and default.
func (f *FlagSet) PrintUsage(w io.Writer) {
	fmt.Fprintf(w, "Usage: %s [flags]\n", f.name)
	if f.synopsis != "" {
		fmt.Fprintf(w, "\n%s\n", f.synopsis)
	}
	fmt.Fprintf(w, "\nSettings (flag, environment variable, default):\n")
	sorted := append([]*setting(nil), f.settings...)
	sort.SliceStable(sorted, func(i, j int) bool { return sorted[i].flag < sorted[j].flag })
	for _, s := range sorted {
		env := s.env
		if env == "" {
			env = "-"
		}
		def := s.def
		if s.secret && def != "" {
			def = "<redacted>"
		} else if def == "" {
			def = `""`
		}
		fmt.Fprintf(w, "  --%s  (env %s, default %s)\n      %s\n", s.flag, env, def, s.usage)
	}
}

// Warnings are the warnings of the last Parse: secrets given as flags,
// secret files that others may read. They are also queued for the process:
// [Common.Logger] logs them with the logger it builds, and [Dispatch]
// prints those no logger took.
func (f *FlagSet) Warnings() []string { return f.warnings }

// registerSecrets registers the secret values with package redact, checks
// the modes of secret files and warns about secrets given as flags.
// parsed are the arguments the flags were parsed from.
func (f *FlagSet) registerSecrets(parsed []string) {
	// The flags given on the command line (Visit also lists those set
	// from the environment).
	onCmdline := map[string]bool{}
	for _, a := range parsed {
		if a == "--" {
			break
		}
		if name, ok := strings.CutPrefix(a, "-"); ok {
			name, _, _ = strings.Cut(strings.TrimPrefix(name, "-"), "=")
			onCmdline[name] = true
		}
	}
	for _, s := range f.settings {
		if s.value == nil || *s.value == "" {
			continue
		}
		v := *s.value
		switch {
		case s.secret && s.conn:
			redact.AddConnString(v)
			if onCmdline[s.flag] && redact.URL(v) != v {
				f.warnFlag(s)
			}
		case s.secret:
			redact.Add(v)
			if onCmdline[s.flag] {
				f.warnFlag(s)
			}
		case s.secretFile:
			f.checkSecretFile(s, v)
		}
	}
}

// warnFlag warns that a secret was given on the command line.
func (f *FlagSet) warnFlag(s *setting) {
	instead := "set " + s.env + " instead"
	for _, o := range f.settings {
		if s.env != "" && o.env == s.env+"_FILE" {
			instead = "set " + s.env + " or " + o.env + " instead"
		}
	}
	if s.env == "" {
		instead = "pass it in a file instead"
	}
	f.warnings = append(f.warnings, fmt.Sprintf("--%s is given on the command line, where every local user can read it (/proc/PID/cmdline, ps); %s", s.flag, instead))
}

// checkSecretFile warns when a secret file's group or others may read it,
// and registers its content (as another package will read it: whole, or
// with surrounding white space or a trailing newline dropped).
func (f *FlagSet) checkSecretFile(s *setting, path string) {
	name := s.env
	if name == "" {
		name = "--" + s.flag
	}
	if fi, err := os.Stat(path); err == nil {
		// Group and others: the bits a Docker or Kubernetes secret
		// mounted 0400/0600 does not have.
		if m := fi.Mode().Perm(); m&0o077 != 0 {
			who := "its group"
			switch {
			case m&0o070 == 0:
				who = "others"
			case m&0o007 != 0:
				who = "its group and others"
			}
			f.warnings = append(f.warnings, fmt.Sprintf("%s=%q is readable by %s (mode %04o): chmod 600 the file (or mount the secret with mode 0400)", name, path, who, m))
		}
	}
	if b, err := os.ReadFile(path); err == nil {
		v := string(b)
		redact.Add(v, strings.TrimSpace(v), strings.TrimRight(v, "\r\n"), strings.TrimSuffix(strings.TrimSuffix(v, "\n"), "\r"))
	}
}

// pending are the warnings of every Parse not yet taken.
var pending struct {
	mu sync.Mutex
	w  []string
}

func addWarnings(w []string) {
	pending.mu.Lock()
	defer pending.mu.Unlock()
	pending.w = append(pending.w, w...)
}

// takeWarnings returns the queued warnings and empties the queue.
func takeWarnings() []string {
	pending.mu.Lock()
	defer pending.mu.Unlock()
	w := pending.w
	pending.w = nil
	return w
}

// Stdout is the binaries' standard output: every secret registered with
// package redact is masked in what the commands print (status, lists).
var Stdout io.Writer = redact.Writer(os.Stdout)
