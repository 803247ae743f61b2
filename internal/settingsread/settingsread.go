// Package settingsread reads a built binary's settings: it runs the
// hidden sub-command cli.SettingsCommand and decodes its JSON. The tools
// that check the documentation against the binaries use it
// (internal/cmd/docgen for docs/configuration.md, the docs package's test
// of the commands the pages show).
package settingsread

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"

	"github.com/outboxrelay/outboxrelay/internal/cli"
)

// Read runs bin's settings command and returns what it declares. The
// settings must not depend on the caller's environment: the binary runs
// with PATH alone.
func Read(ctx context.Context, bin string) (cli.Binary, error) {
	var stdout, stderr bytes.Buffer
	run := exec.CommandContext(ctx, bin, cli.SettingsCommand)
	run.Env = []string{"PATH=" + os.Getenv("PATH")}
	run.Stdout, run.Stderr = &stdout, &stderr
	name := filepath.Base(bin)
	if err := run.Run(); err != nil {
		return cli.Binary{}, fmt.Errorf("%s %s: %w\n%s", name, cli.SettingsCommand, err, stderr.Bytes())
	}
	var b cli.Binary
	if err := json.Unmarshal(stdout.Bytes(), &b); err != nil {
		return cli.Binary{}, fmt.Errorf("%s %s: %w", name, cli.SettingsCommand, err)
	}
	return b, nil
}
