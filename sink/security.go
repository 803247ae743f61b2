package sink

import (
	"time"

	"github.com/segmentio/kafka-go"
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
