package kafkaconn_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/kafkaconn"
	"github.com/outboxrelay/outboxrelay/internal/redact"
)

// The SASL password, given directly or in KAFKA_SASL_PASSWORD_FILE, is
// registered with package redact when the settings are built, so a log
// line or an error quoting it is masked.
func TestBuildRegistersSASLPassword(t *testing.T) {
	t.Parallel()
	file := filepath.Join(t.TempDir(), "pw")
	require.NoError(t, os.WriteFile(file, []byte("kafka-file-pw\n"), 0o600))
	_, err := kafkaconn.Settings{Mechanism: "PLAIN", Username: "u", PasswordFile: file}.Build(nil)
	require.NoError(t, err)
	_, err = kafkaconn.Settings{Mechanism: "SCRAM-SHA-512", Username: "u", Password: "kafka-direct-pw"}.Build(nil)
	require.NoError(t, err)
	require.Equal(t, "SASL failed for xxxxx and xxxxx", redact.String("SASL failed for kafka-file-pw and kafka-direct-pw"))
}
