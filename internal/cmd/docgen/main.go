// Command docgen renders docs/configuration.md, the configuration
// reference, from the binaries' own settings: it builds batcher, publisher
// and indexer, asks each for its settings (the hidden sub-command
// cli.SettingsCommand, JSON) and writes one table per sub-command; and
// the keys of a job spec from the declaration of batch.Spec. `make
// docs` runs it; TestConfigurationReferenceIsCurrent fails when the
// committed page differs from what it renders.
//
//	go run ./internal/cmd/docgen            # writes docs/configuration.md
//	go run ./internal/cmd/docgen -o -       # prints it
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/outboxrelay/outboxrelay/internal/cli"
	"github.com/outboxrelay/outboxrelay/internal/settingsread"
)

// binaries are the binaries the page covers, in its order.
var binaries = []string{"batcher", "publisher", "indexer"}

// page is where the reference lives, relative to the repository root.
const page = "docs/configuration.md"

// regenerate is the command that rewrites the page, quoted in its header
// and in the test's failure.
const regenerate = "make docs (go run ./internal/cmd/docgen)"

func main() {
	out := flag.String("o", "", "output file (default: "+page+" in the repository; - = standard output)")
	flag.Parse()
	root, err := repoRoot()
	if err != nil {
		fail(err)
	}
	bins, err := collect(context.Background(), root)
	if err != nil {
		fail(err)
	}
	spec, err := specFields(root)
	if err != nil {
		fail(err)
	}
	text := render(bins, spec)
	switch *out {
	case "-":
		_, err = os.Stdout.WriteString(text)
	case "":
		err = os.WriteFile(filepath.Join(root, page), []byte(text), 0o644)
	default:
		err = os.WriteFile(*out, []byte(text), 0o644)
	}
	if err != nil {
		fail(err)
	}
}

func fail(err error) {
	fmt.Fprintf(os.Stderr, "docgen: %v\n", err)
	os.Exit(1)
}

// repoRoot is the directory of the main module's go.mod.
func repoRoot() (string, error) {
	b, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		return "", fmt.Errorf("go env GOMOD: %w", err)
	}
	mod := strings.TrimSpace(string(b))
	if mod == "" || mod == os.DevNull {
		return "", fmt.Errorf("not inside the outboxrelay module")
	}
	return filepath.Dir(mod), nil
}

// collect builds each binary (release build: no tags) into a temporary
// directory and reads its settings.
func collect(ctx context.Context, root string) ([]cli.Binary, error) {
	dir, err := os.MkdirTemp("", "docgen-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	var out []cli.Binary
	for _, name := range binaries {
		bin := filepath.Join(dir, name)
		build := exec.CommandContext(ctx, "go", "build", "-o", bin, "./cmd/"+name)
		build.Dir = root
		if b, err := build.CombinedOutput(); err != nil {
			return nil, fmt.Errorf("go build ./cmd/%s: %w\n%s", name, err, b)
		}
		b, err := settingsread.Read(ctx, bin)
		if err != nil {
			return nil, err
		}
		out = append(out, b)
	}
	return out, nil
}
