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

// REQUIRE_TLS accepts what verifies the brokers and refuses the rest, one
// line naming the setting to change.
func TestRequireTLS(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		s    kafkaconn.Settings
		want string // "" = accepted
	}{
		{"plaintext", kafkaconn.Settings{}, "REQUIRE_TLS=true: Kafka is plaintext: set KAFKA_TLS=true"},
		{"SASL without TLS", kafkaconn.Settings{Mechanism: "PLAIN", Username: "u", Password: "s3cret"}, "REQUIRE_TLS=true: Kafka is plaintext"},
		{"TLS not verified", kafkaconn.Settings{TLS: true, InsecureSkipVerify: true}, "REQUIRE_TLS=true: KAFKA_TLS_INSECURE_SKIP_VERIFY=true"},
		{"TLS, system roots", kafkaconn.Settings{TLS: true}, ""},
		{"SASL_SSL", kafkaconn.Settings{TLS: true, Mechanism: "SCRAM-SHA-512", Username: "u", Password: "s3cret"}, ""},
	} {
		tc.s.RequireTLS = true
		_, err := tc.s.Build(nil)
		if tc.want == "" {
			require.NoError(t, err, tc.name)
			continue
		}
		require.ErrorContains(t, err, tc.want, tc.name)
		require.NotContains(t, err.Error(), "\n")
		require.NotContains(t, err.Error(), "s3cret")
	}
}
