package kafkaconn_test

import (
	"bytes"
	"log/slog"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/kafkaconn"
)

// SASL without TLS sends the credentials (PLAIN: the password itself;
// SCRAM: an exchange that can be attacked offline) and all data in clear:
// Build says so at every start, without the password. With TLS it is quiet.
func TestSASLWithoutTLSIsLogged(t *testing.T) {
	t.Parallel()
	for _, mech := range []string{"PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"} {
		var logs bytes.Buffer
		logger := slog.New(slog.NewTextHandler(&logs, nil))
		_, err := kafkaconn.Settings{Mechanism: mech, Username: "relay", Password: "s3cret"}.Build(logger)
		require.NoError(t, err)
		require.Contains(t, logs.String(), "level=WARN", mech)
		require.Contains(t, logs.String(), "KAFKA_SASL_MECHANISM="+mech+" without KAFKA_TLS", mech)
		require.NotContains(t, logs.String(), "s3cret")

		logs.Reset()
		_, err = kafkaconn.Settings{TLS: true, Mechanism: mech, Username: "relay", Password: "s3cret"}.Build(logger)
		require.NoError(t, err)
		require.Empty(t, logs.String(), mech)
	}
}
