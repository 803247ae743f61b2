// Package migrations holds outboxrelay's SQL schema as numbered files
// (NNN_name.up.sql), embedded into every binary. Apply them with the
// `migrate` sub-command of any binary, or from Go with
// [github.com/outboxrelay/outboxrelay/internal/migrate.Up].
package migrations

import "embed"

// FS holds every NNN_name.up.sql file of this directory.
//
//go:embed *.up.sql
var FS embed.FS
