package cli

import (
	"context"
	"fmt"
	"io"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
)

// SettingsCommand is the hidden sub-command every binary answers with its
// settings as JSON ([Binary]): the binary's command list lives in its
// package main, so the binary itself is what can say which settings it
// reads. internal/cmd/docgen renders docs/configuration.md from it. It is
// not listed in the help.
const SettingsCommand = "__settings"

// Binary describes a binary's commands and their settings.
type Binary struct {
	Name  string `json:"name"`
	About string `json:"about"`
	// Commands are the sub-commands with their settings, in the order of
	// the binary's help.
	Commands []DescribedCommand `json:"commands"`
}

// DescribedCommand is one sub-command and the settings its flag set
// declares, sorted by flag as --help lists them.
type DescribedCommand struct {
	Name     string             `json:"name"`
	Summary  string             `json:"summary"`
	Synopsis string             `json:"synopsis,omitempty"`
	Settings []DescribedSetting `json:"settings"`
}

// DescribedSetting is one setting: its flag, environment variable ("" for
// a flag-only setting), default as --help shows it, and help.
type DescribedSetting struct {
	Flag    string `json:"flag"`
	Env     string `json:"env,omitempty"`
	Default string `json:"default"`
	// Kind is string, integer, number, boolean or duration.
	Kind  string `json:"kind"`
	Usage string `json:"usage"`
	// Secret: the value is masked in logs and errors, and its default is
	// never shown. FileFlag names the flag of its *_FILE form, if any.
	Secret   bool   `json:"secret,omitempty"`
	FileFlag string `json:"file_flag,omitempty"`
	// SecretFile: the value names a file holding a secret. FileOf names
	// the flag whose *_FILE form this is, if it is one.
	SecretFile bool   `json:"secret_file,omitempty"`
	FileOf     string `json:"file_of,omitempty"`
}

// describing, when set, makes every Parse record its flag set and return
// flag.ErrHelp before it reads the environment or the arguments: a
// command's Run then stops before it does anything (every command parses
// its settings first).
var describing struct {
	mu  sync.Mutex
	on  atomic.Bool // read by every Parse
	got []*FlagSet  // appended to by Parse in Describe's goroutine
}

// Describe runs each command's Run with Parse short-circuited and returns
// the settings its flag set declares. A command that parses no
// [FlagSet] is an error: its settings could not be listed.
func Describe(ctx context.Context, binary, about string, commands []Command) (Binary, error) {
	describing.mu.Lock()
	defer describing.mu.Unlock()
	describing.on.Store(true)
	defer func() { describing.on.Store(false); describing.got = nil }()
	b := Binary{Name: binary, About: about}
	for _, c := range commands {
		describing.got = nil
		_ = c.Run(ctx, []string{"--help"})
		if len(describing.got) != 1 {
			return b, fmt.Errorf("%s %s: parsed %d flag sets, want 1", binary, c.Name, len(describing.got))
		}
		fs := describing.got[0]
		d := DescribedCommand{Name: c.Name, Summary: c.Summary, Synopsis: fs.synopsis, Settings: fs.describe()}
		b.Commands = append(b.Commands, d)
	}
	return b, nil
}

// describeParse is Parse's short-circuit while describing.
func (f *FlagSet) describeParse() bool {
	if !describing.on.Load() {
		return false
	}
	describing.got = append(describing.got, f)
	return true
}

func (f *FlagSet) describe() []DescribedSetting {
	fileOf := map[*string]string{} // the file setting's value → the secret's flag
	fileFlag := map[string]string{}
	for _, sf := range f.files {
		for _, s := range f.settings {
			if s.value == sf.dst {
				fileOf[&sf.file] = s.flag
			}
		}
	}
	for _, s := range f.settings {
		if s.value != nil {
			if of, ok := fileOf[s.value]; ok {
				fileFlag[of] = s.flag
			}
		}
	}
	var out []DescribedSetting
	for _, s := range f.settings {
		d := DescribedSetting{Flag: s.flag, Env: s.env, Default: s.def, Kind: kind(s.want), Usage: s.usage, Secret: s.secret, SecretFile: s.secretFile}
		if s.secret && d.Default != "" {
			d.Default = "<redacted>"
		}
		d.FileFlag = fileFlag[s.flag]
		if s.value != nil {
			d.FileOf = fileOf[s.value]
		}
		out = append(out, d)
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].Flag < out[j].Flag })
	return out
}

func kind(want string) string {
	switch {
	case want == "an integer":
		return "integer"
	case want == "a number":
		return "number"
	case want == "true or false":
		return "boolean"
	case strings.HasPrefix(want, "a duration"):
		return "duration"
	}
	return "string"
}

// writeSettings answers [SettingsCommand].
func writeSettings(ctx context.Context, binary, about string, commands []Command, stdout, stderr io.Writer) int {
	b, err := Describe(ctx, binary, about, commands)
	if err != nil {
		fmt.Fprintf(stderr, "%s %s: %v\n", binary, SettingsCommand, err)
		return ExitError1
	}
	if err := WriteJSON(stdout, b); err != nil {
		return ExitError1
	}
	return ExitOK
}
