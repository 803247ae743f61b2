// Package e2e holds whole-pipeline tests: the real binaries as separate
// processes against the real PostgreSQL, Kafka broker and search engine.
package e2e

import (
	"testing"

	"github.com/outboxrelay/outboxrelay/internal/stack"
)

func TestMain(m *testing.M) { stack.Main(m) }
