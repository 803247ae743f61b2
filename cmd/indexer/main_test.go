package main

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/cli"
)

func TestBadSettingsExitWithUsage(t *testing.T) {
	t.Setenv("KAFKA_BROKERS", "127.0.0.1:1")
	t.Setenv("ELASTICSEARCH_URL", "http://127.0.0.1:1")
	tests := []struct {
		name string
		args []string
		env  map[string]string
		want string
	}{
		{name: "no brokers", args: []string{"run"}, env: map[string]string{"KAFKA_BROKERS": ""}, want: "KAFKA_BROKERS is required"},
		{name: "no engine", args: []string{"run"}, env: map[string]string{"ELASTICSEARCH_URL": ""}, want: "ELASTICSEARCH_URL is required"},
		{name: "lanes out of range", args: []string{"run", "--lanes", "1000"}, want: "LANES=1000"},
		{name: "bad env duration", args: []string{"run"}, env: map[string]string{"FLUSH_INTERVAL": "soon"}, want: `FLUSH_INTERVAL="soon"`},
		{name: "missing mapping file", args: []string{"run", "--mapping-file", "/nonexistent.json"}, want: `MAPPING_FILE="/nonexistent.json"`},
		{name: "bad route", args: []string{"run", "--routes", "orders"}, want: `"orders" is not aggregate_type=alias`},
		{name: "bad null-values", args: []string{"run"}, env: map[string]string{"NULL_VALUES": "drop"}, want: `NULL_VALUES="drop"`},
		{name: "bad id-format", args: []string{"run", "--id-format", "uuid"}, want: `ID_FORMAT="uuid"`},
		{name: "dead-letter topic too small", args: []string{"run", "--dead-letter-max-bytes", "1000"}, want: "DEAD_LETTER_MAX_BYTES=1000"},
		{name: "auto cutover without database", args: []string{"run", "--auto-cutover", "records"}, env: map[string]string{"DATABASE_URL": ""}, want: "AUTO_CUTOVER=records needs DATABASE_URL"},
		{name: "auto cutover of typed ids", args: []string{"run"}, env: map[string]string{"AUTO_CUTOVER": "records", "DATABASE_URL": "postgres://127.0.0.1:1/x", "ID_FORMAT": "type:id"}, want: "ID_FORMAT=type:id"},
		{name: "reconcile of typed ids", args: []string{"reconcile"}, env: map[string]string{"ID_FORMAT": "type:id"}, want: "ID_FORMAT=type:id"},
		{name: "scheduled purge without database", args: []string{"run", "--tombstone-purge-interval", "1h"}, env: map[string]string{"DATABASE_URL": ""}, want: "TOMBSTONE_PURGE_INTERVAL=1h0m0s needs DATABASE_URL"},
		{name: "purge without database", args: []string{"tombstones", "purge"}, env: map[string]string{"DATABASE_URL": ""}, want: "indexer tombstones purge needs DATABASE_URL"},
		{name: "negative purge margin", args: []string{"tombstones", "purge", "--tombstone-purge-margin", "-1s"}, want: "TOMBSTONE_PURGE_MARGIN=-1s"},
		{name: "reindex without --into", args: []string{"reindex"}, want: "--into is required"},
		{name: "unknown command", args: []string{"frobnicate"}, want: "unknown command"},
		{name: "replay to another topic", args: []string{"dead-letter", "replay", "--to", "payments"}, want: "--to=payments: dead letters are replayed only to the topic this indexer consumes, TOPIC=outboxrelay.records"},
		// REQUIRE_TLS refuses each connection that does not verify its server.
		{name: "require TLS, plaintext Kafka", args: []string{"run"}, env: map[string]string{"REQUIRE_TLS": "true"},
			want: "REQUIRE_TLS=true: Kafka is plaintext: set KAFKA_TLS=true"},
		{name: "require TLS, Kafka not verified", args: []string{"dead-letter", "replay", "--require-tls"}, env: map[string]string{"KAFKA_TLS_INSECURE_SKIP_VERIFY": "true"},
			want: "REQUIRE_TLS=true: KAFKA_TLS_INSECURE_SKIP_VERIFY=true does not verify the brokers"},
		{name: "require TLS, http engine", args: []string{"reindex", "--into", "x"}, env: map[string]string{"REQUIRE_TLS": "true"},
			want: "REQUIRE_TLS=true: ELASTICSEARCH_URL http://127.0.0.1:1 is not https"},
		{name: "require TLS, database", args: []string{"reconcile"}, env: map[string]string{"REQUIRE_TLS": "true", "DATABASE_URL": "postgres://u:pw@127.0.0.1:1,db.example:5432/x?sslmode=require"},
			want: "REQUIRE_TLS=true: DATABASE_URL does not verify the server of 127.0.0.1:1, db.example:5432"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for k, v := range tt.env {
				t.Setenv(k, v)
			}
			var stdout, stderr bytes.Buffer
			code := cli.Dispatch(context.Background(), "indexer", "test", commands(), tt.args, &stdout, &stderr)
			require.Equal(t, cli.ExitUsage, code, stderr.String())
			require.Contains(t, stderr.String(), tt.want)
			if strings.HasPrefix(tt.want, "REQUIRE_TLS") {
				require.Equal(t, 1, strings.Count(stderr.String(), "\n"), "one line: %s", stderr.String())
				require.NotContains(t, stderr.String(), ":pw@")
			}
		})
	}
}
