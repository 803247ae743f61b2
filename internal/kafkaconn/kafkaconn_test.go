package kafkaconn_test

import (
	"bytes"
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/sasl/plain"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/kafkaconn"
	"github.com/outboxrelay/outboxrelay/internal/stack"
)

func TestMain(m *testing.M) { stack.Main(m) }

// Settings that cannot work fail in Build, naming the setting, before any
// connection; a secret never appears in the message.
func TestBuildRefusesIncompleteSettings(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	pwFile := filepath.Join(dir, "pw")
	require.NoError(t, os.WriteFile(pwFile, []byte("s3cret-from-file\n"), 0o600))
	userFile := filepath.Join(dir, "user")
	require.NoError(t, os.WriteFile(userFile, []byte("bob\n"), 0o600))
	notPEM := filepath.Join(dir, "ca.pem")
	require.NoError(t, os.WriteFile(notPEM, []byte("not a certificate"), 0o600))

	for _, tc := range []struct {
		name string
		s    kafkaconn.Settings
		want string
	}{
		{"mechanism without user", kafkaconn.Settings{Mechanism: "SCRAM-SHA-512", Password: "s3cret"}, "KAFKA_SASL_USERNAME"},
		{"mechanism without password", kafkaconn.Settings{Mechanism: "PLAIN", Username: "alice"}, "KAFKA_SASL_PASSWORD"},
		{"credentials without mechanism", kafkaconn.Settings{Username: "alice", Password: "s3cret"}, "KAFKA_SASL_MECHANISM"},
		{"unknown mechanism", kafkaconn.Settings{Mechanism: "GSSAPI", Username: "alice", Password: "s3cret"}, "KAFKA_SASL_MECHANISM"},
		{"password and password file", kafkaconn.Settings{Mechanism: "PLAIN", Username: "alice", Password: "s3cret", PasswordFile: pwFile}, "KAFKA_SASL_PASSWORD_FILE"},
		{"missing password file", kafkaconn.Settings{Mechanism: "PLAIN", Username: "alice", PasswordFile: filepath.Join(dir, "none")}, "KAFKA_SASL_PASSWORD_FILE"},
		{"user and user file", kafkaconn.Settings{Mechanism: "PLAIN", Username: "alice", UsernameFile: userFile, Password: "s3cret"}, "KAFKA_SASL_USERNAME_FILE"},
		{"missing user file", kafkaconn.Settings{Mechanism: "PLAIN", UsernameFile: filepath.Join(dir, "none"), Password: "s3cret"}, "KAFKA_SASL_USERNAME_FILE"},
		{"CA file without PEM", kafkaconn.Settings{TLS: true, CAFile: notPEM}, "KAFKA_TLS_CA_FILE"},
		{"cert without key", kafkaconn.Settings{CertFile: notPEM}, "KAFKA_TLS_KEY_FILE"},
		{"key without cert", kafkaconn.Settings{KeyFile: notPEM}, "KAFKA_TLS_CERT_FILE"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := tc.s.Build(nil)
			require.Error(t, err)
			require.Contains(t, err.Error(), tc.want)
			require.NotContains(t, err.Error(), "s3cret")
		})
	}

	sec, err := kafkaconn.Settings{Mechanism: "scram-sha-256", Username: "alice", PasswordFile: pwFile}.Build(nil)
	require.NoError(t, err)
	require.Equal(t, "SCRAM-SHA-256", sec.SASL.Name())
	require.Nil(t, sec.TLS)
	require.Equal(t, "SASL_PLAINTEXT SCRAM-SHA-256 as alice", sec.String())

	// Both credentials from files (Docker/Kubernetes secrets), the
	// trailing newline dropped.
	sec, err = kafkaconn.Settings{Mechanism: "PLAIN", UsernameFile: userFile, PasswordFile: pwFile}.Build(nil)
	require.NoError(t, err)
	require.Equal(t, plain.Mechanism{Username: "bob", Password: "s3cret-from-file"}, sec.SASL)
	require.Equal(t, "SASL_PLAINTEXT PLAIN as bob", sec.String())

	plain, err := kafkaconn.Settings{}.Build(nil)
	require.NoError(t, err)
	require.Nil(t, plain.TLS)
	require.Nil(t, plain.SASL)
}

// Each mechanism against the real secured broker: the probe passes, and a
// record written through the configured transport is read back through the
// configured dialer.
func TestSecuredBrokerEachMechanism(t *testing.T) {
	t.Parallel()
	k := stack.SecuredKafka(t)
	env := k.Settings
	saslSSL := []string{env["KAFKA_SASL_SSL_BROKERS"]}
	for _, tc := range []struct {
		name    string
		brokers []string
		s       kafkaconn.Settings
	}{
		{"SASL_SSL PLAIN", saslSSL, kafkaconn.Settings{CAFile: env["KAFKA_TLS_CA_FILE"], Mechanism: "PLAIN", Username: env["KAFKA_SASL_USERNAME"], Password: env["KAFKA_SASL_PASSWORD"]}},
		{"SASL_SSL SCRAM-SHA-256", saslSSL, kafkaconn.Settings{TLS: true, CAFile: env["KAFKA_TLS_CA_FILE"], Mechanism: "SCRAM-SHA-256", Username: env["KAFKA_SASL_USERNAME"], Password: env["KAFKA_SASL_PASSWORD"]}},
		{"SASL_SSL SCRAM-SHA-512", saslSSL, kafkaconn.Settings{TLS: true, CAFile: env["KAFKA_TLS_CA_FILE"], Mechanism: "SCRAM-SHA-512", Username: env["KAFKA_SASL_USERNAME"], Password: env["KAFKA_SASL_PASSWORD"]}},
		{"SSL mTLS", []string{env["KAFKA_SSL_BROKERS"]}, kafkaconn.Settings{TLS: true, CAFile: env["KAFKA_TLS_CA_FILE"], CertFile: env["KAFKA_TLS_CERT_FILE"], KeyFile: env["KAFKA_TLS_KEY_FILE"]}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			sec, err := tc.s.Build(nil)
			require.NoError(t, err)
			require.NoError(t, sec.Probe(ctx, tc.brokers))

			topic := stack.UniqueName("kafkaconn")
			tr := sec.Transport(&kafka.Transport{})
			defer tr.CloseIdleConnections()
			c := &kafka.Client{Addr: kafka.TCP(tc.brokers...), Transport: tr}
			ct, err := c.CreateTopics(ctx, &kafka.CreateTopicsRequest{Topics: []kafka.TopicConfig{{Topic: topic, NumPartitions: 1, ReplicationFactor: 1}}})
			require.NoError(t, err)
			for _, e := range ct.Errors {
				require.NoError(t, e)
			}
			w := &kafka.Writer{Addr: kafka.TCP(tc.brokers...), Topic: topic, RequiredAcks: kafka.RequireAll, Transport: tr}
			defer w.Close()
			require.NoError(t, w.WriteMessages(ctx, kafka.Message{Key: []byte("k"), Value: []byte(tc.name)}))

			r := kafka.NewReader(kafka.ReaderConfig{Brokers: tc.brokers, Topic: topic, Partition: 0, Dialer: sec.Dialer(), MaxWait: 250 * time.Millisecond})
			defer r.Close()
			m, err := r.ReadMessage(ctx)
			require.NoError(t, err)
			require.Equal(t, tc.name, string(m.Value))
		})
	}
}

// Every wrong credential, untrusted certificate or mismatched protocol
// fails the start-up probe within seconds, in one line that names the
// setting, without the password; and nothing reaches the broker.
func TestSecuredBrokerFailsFast(t *testing.T) {
	t.Parallel()
	k := stack.SecuredKafka(t)
	env := k.Settings
	saslSSL := []string{env["KAFKA_SASL_SSL_BROKERS"]}
	ssl := []string{env["KAFKA_SSL_BROKERS"]}
	ca, user := env["KAFKA_TLS_CA_FILE"], env["KAFKA_SASL_USERNAME"]
	const wrong = "not-the-password"
	for _, tc := range []struct {
		name    string
		brokers []string
		s       kafkaconn.Settings
		want    string
	}{
		{"wrong password PLAIN", saslSSL, kafkaconn.Settings{CAFile: ca, Mechanism: "PLAIN", Username: user, Password: wrong}, "KAFKA_SASL_PASSWORD"},
		{"wrong password SCRAM-SHA-256", saslSSL, kafkaconn.Settings{CAFile: ca, Mechanism: "SCRAM-SHA-256", Username: user, Password: wrong}, "KAFKA_SASL_PASSWORD"},
		{"wrong password SCRAM-SHA-512", saslSSL, kafkaconn.Settings{CAFile: ca, Mechanism: "SCRAM-SHA-512", Username: user, Password: wrong}, "KAFKA_SASL_PASSWORD"},
		{"unknown user", saslSSL, kafkaconn.Settings{CAFile: ca, Mechanism: "SCRAM-SHA-512", Username: "mallory", Password: wrong}, "KAFKA_SASL_USERNAME"},
		{"untrusted broker certificate", saslSSL, kafkaconn.Settings{CAFile: env["KAFKA_OTHER_CA_FILE"], Mechanism: "SCRAM-SHA-512", Username: user, Password: wrong}, "KAFKA_TLS_CA_FILE"},
		{"system roots only", saslSSL, kafkaconn.Settings{TLS: true, Mechanism: "SCRAM-SHA-512", Username: user, Password: wrong}, "KAFKA_TLS_CA_FILE"},
		{"SASL_SSL without SASL", saslSSL, kafkaconn.Settings{CAFile: ca}, "KAFKA_SASL_MECHANISM"},
		{"SASL_SSL without TLS", saslSSL, kafkaconn.Settings{Mechanism: "SCRAM-SHA-512", Username: user, Password: wrong}, "KAFKA_TLS"},
		{"mTLS without client certificate", ssl, kafkaconn.Settings{CAFile: ca}, "KAFKA_TLS_CERT_FILE"},
		{"mTLS with an untrusted client certificate", ssl, kafkaconn.Settings{CAFile: ca, CertFile: env["KAFKA_OTHER_CERT_FILE"], KeyFile: env["KAFKA_OTHER_KEY_FILE"]}, "KAFKA_TLS_CERT_FILE"},
		{"TLS to the plaintext listener", []string{k.Env}, kafkaconn.Settings{CAFile: ca}, "KAFKA_TLS"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			sec, err := tc.s.Build(nil)
			require.NoError(t, err)
			start := time.Now()
			err = sec.Probe(context.Background(), tc.brokers)
			took := time.Since(start)
			require.Error(t, err)
			var pe *kafkaconn.ProbeError
			require.ErrorAs(t, err, &pe)
			msg := err.Error()
			t.Logf("%s after %s: %s", tc.name, took.Round(time.Millisecond), msg)
			require.Less(t, took, kafkaconn.DefaultProbeLimit, "the probe must not wait out a retry loop")
			require.Contains(t, msg, tc.want)
			require.NotContains(t, msg, "\n")
			require.NotContains(t, msg, wrong)
			require.NotContains(t, msg, env["KAFKA_SASL_PASSWORD"])
		})
	}

	// Nothing got through: a writer with the wrong password fails and the
	// topic it names does not exist (seen over the plaintext listener).
	ctx := context.Background()
	sec, err := kafkaconn.Settings{CAFile: ca, Mechanism: "SCRAM-SHA-512", Username: user, Password: wrong}.Build(nil)
	require.NoError(t, err)
	topic := stack.UniqueName("kafkaconn-denied")
	w := &kafka.Writer{Addr: kafka.TCP(saslSSL...), Topic: topic, AllowAutoTopicCreation: true, MaxAttempts: 1, Transport: sec.Transport(&kafka.Transport{})}
	defer w.Close()
	require.Error(t, w.WriteMessages(ctx, kafka.Message{Value: []byte("x")}))
	md, err := (&kafka.Client{Addr: kafka.TCP(k.Env)}).Metadata(ctx, &kafka.MetadataRequest{Topics: []string{topic}})
	require.NoError(t, err)
	require.Len(t, md.Topics, 1)
	require.ErrorIs(t, md.Topics[0].Error, kafka.UnknownTopicOrPartition, "a denied client created %s", topic)
}

// Skipping verification is an explicit opt-out, and it is logged loudly.
func TestInsecureSkipVerifyIsLogged(t *testing.T) {
	t.Parallel()
	k := stack.SecuredKafka(t)
	env := k.Settings
	var logs bytes.Buffer
	logger := slog.New(slog.NewTextHandler(&logs, nil))
	sec, err := kafkaconn.Settings{InsecureSkipVerify: true, CAFile: env["KAFKA_OTHER_CA_FILE"], Mechanism: "SCRAM-SHA-256",
		Username: env["KAFKA_SASL_USERNAME"], Password: env["KAFKA_SASL_PASSWORD"]}.Build(logger)
	require.NoError(t, err)
	require.Contains(t, logs.String(), "level=WARN")
	require.Contains(t, logs.String(), "KAFKA_TLS_INSECURE_SKIP_VERIFY=true")
	require.NotContains(t, logs.String(), env["KAFKA_SASL_PASSWORD"])
	// An untrusted certificate is accepted only because of the opt-out.
	require.NoError(t, sec.Probe(context.Background(), []string{env["KAFKA_SASL_SSL_BROKERS"]}))
}

// A broker that is down is not a configuration error: the probe logs it
// and lets the caller's own retries wait for the broker.
func TestProbeToleratesABrokerThatIsDown(t *testing.T) {
	t.Parallel()
	sec, err := kafkaconn.Settings{}.Build(nil)
	require.NoError(t, err)
	// Port 1 on loopback: nothing listens, the dial is refused at once.
	require.NoError(t, sec.Probe(context.Background(), []string{"127.0.0.1:1"}))
}
