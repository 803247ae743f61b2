package logging_test

import (
	"bytes"
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/logging"
	"github.com/outboxrelay/outboxrelay/internal/redact"
)

// Every logger the binaries build masks the secrets read from the settings,
// in both formats.
func TestLoggerMasksRegisteredSecrets(t *testing.T) {
	redact.AddConnString("postgres://relay:123?l0g-s3cret@db/x")
	for _, format := range []string{"json", "text"} {
		var buf bytes.Buffer
		l, err := logging.New(&buf, logging.Options{Format: format})
		require.NoError(t, err)
		l.Error("connect failed: password 123?l0g-s3cret", "error", errors.New("auth failed for 123?l0g-s3cret"), "url", "postgres://relay:123?l0g-s3cret@db/x")
		require.NotContains(t, buf.String(), "l0g-s3cret", format)
		require.Contains(t, buf.String(), "connect failed: password "+redact.Mask, format)
	}
}
