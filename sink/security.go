package sink

import (
	"context"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/sasl"
	"github.com/twmb/franz-go/pkg/kgo"
	kgosasl "github.com/twmb/franz-go/pkg/sasl"
)

// kafkaTransport is the transport of the indexer's Kafka clients and
// writers: kafka-go's shared default for a plaintext cluster, else one with
// the configured TLS and SASL.
func (c Config) kafkaTransport() kafka.RoundTripper {
	if c.TLS == nil && c.SASL == nil {
		return kafka.DefaultTransport
	}
	return &kafka.Transport{TLS: c.TLS, SASL: c.SASL, ClientID: "outboxrelay-indexer"}
}

// kafkaDialer is the dialer of the indexer's readers, with the configured
// TLS and SASL (nil: plaintext).
func (c Config) kafkaDialer(clientID string) *kafka.Dialer {
	return &kafka.Dialer{Timeout: 10 * time.Second, DualStack: true, TLS: c.TLS, SASLMechanism: c.SASL, ClientID: clientID}
}

// kgoSecurity is the configured TLS and SASL as franz-go options, for the
// partition readers (see fetch): the same *tls.Config, and the kafka-go
// SASL mechanism the settings built, driven through franz-go's interface.
func (c Config) kgoSecurity() []kgo.Opt {
	var opts []kgo.Opt
	if c.TLS != nil {
		opts = append(opts, kgo.DialTLSConfig(c.TLS.Clone()))
	}
	if c.SASL != nil {
		opts = append(opts, kgo.SASL(kgoSASL{c.SASL}))
	}
	return opts
}

// kgoSASL runs a kafka-go SASL mechanism (PLAIN, SCRAM) as a franz-go one:
// both are a name and a challenge/response state machine.
type kgoSASL struct{ m sasl.Mechanism }

func (k kgoSASL) Name() string { return k.m.Name() }

func (k kgoSASL) Authenticate(ctx context.Context, _ string) (kgosasl.Session, []byte, error) {
	sm, first, err := k.m.Start(ctx)
	if err != nil {
		return nil, nil, err
	}
	return kgoSASLSession{ctx: ctx, sm: sm}, first, nil
}

type kgoSASLSession struct {
	ctx context.Context //nolint:containedctx // the handshake's, for kafka-go's Next
	sm  sasl.StateMachine
}

func (s kgoSASLSession) Challenge(challenge []byte) (bool, []byte, error) {
	return s.sm.Next(s.ctx, challenge)
}
