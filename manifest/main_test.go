package manifest_test

import (
	"testing"

	"github.com/outboxrelay/outboxrelay/internal/stack"
)

func TestMain(m *testing.M) { stack.Main(m) }
