// Package kafkakey says which partition a record key goes to. Every writer
// that sends keyed records of the pipeline (the publisher, dead-letter
// replay) uses [Balancer], so one key always lands on one partition of a
// topic and its events keep their order.
package kafkakey

import "github.com/segmentio/kafka-go"

// Balancer returns the partitioner for keyed records: murmur2 of the key
// modulo the partition count, as the Java client's default partitioner
// does, so other producers (Kafka Connect, Java services) writing the same
// keys agree. A new value per writer: kafka-go's balancers keep round-robin
// state for records without a key.
func Balancer() kafka.Balancer { return &kafka.Murmur2Balancer{} }
