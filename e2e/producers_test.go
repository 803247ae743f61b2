package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/outboxrelay/outboxrelay/internal/stack"
	"github.com/outboxrelay/outboxrelay/outbox"
)

// producerExample is one of examples/producers, run as a process.
type producerExample struct {
	lang string   // also the value of its "producer" header
	dir  string   // under examples/producers
	cmd  []string // run in dir, followed by id, name, price
	// ready is a file the setup (`make producers`) leaves behind, in dir;
	// or, with readyCmd, a command that succeeds once it ran.
	ready    string
	readyCmd []string
}

// examples/producers/setup.sh installs python3-psycopg for Debian's
// python3, hence its path.
var producerExamples = []producerExample{
	{lang: "python", dir: "python", cmd: []string{"/usr/bin/python3", "produce.py"}, readyCmd: []string{"/usr/bin/python3", "-c", "import psycopg"}},
	{lang: "node", dir: "node", cmd: []string{"node", "produce.js"}, ready: "node_modules/pg/package.json"},
	{lang: "java", dir: "java", cmd: []string{"java", "-jar", "target/produce.jar"}, ready: "target/produce.jar"},
}

// printed is the line each example prints about what it committed.
type printed struct {
	EventID  string          `json:"event_id"`
	Topic    string          `json:"topic"`
	ID       string          `json:"id"`
	Version  int64           `json:"version"`
	Document json.RawMessage `json:"document"`
}

// Each producer example (Python with psycopg 3, Node with pg, Java with
// JDBC; docs/producing-events.md) runs twice as a process against a
// pipeline's database, saving one product and its outbox event in one
// transaction each time. The real publisher and indexer carry the events:
// on the topic, each product's key has exactly the two events the example
// printed, version 1 before version 2 with the CloudEvents headers and the
// example's own header; in the index, each product is the second document
// at version 2; nothing is dead-lettered. The database also holds the README
// quick start's `products` table, as a new user's does: the examples' own
// table (shop_products) sits beside it, holds each product at version 2,
// and the quick start's rows are untouched.
//
// Not parallel: it runs before the package's parallel tests (the failover
// and chaos tests with their private clusters), so its JVM, Node and
// Python processes add nothing to the load those put on the shared broker.
func TestProducerExamples(t *testing.T) {
	ctx := context.Background()
	root := filepath.Join(stack.RepoRoot(), "examples", "producers")
	for _, ex := range producerExamples {
		var err error
		if ex.readyCmd != nil {
			var out []byte
			out, err = exec.Command(ex.readyCmd[0], ex.readyCmd[1:]...).CombinedOutput()
			if err != nil {
				err = fmt.Errorf("%v: %w: %s", ex.readyCmd, err, out)
			}
		} else {
			_, err = os.Stat(filepath.Join(root, ex.dir, ex.ready))
		}
		require.NoErrorf(t, err, "the %s example is not set up: run `make producers` (examples/producers/setup.sh)", ex.lang)
	}

	const partitions = 3
	p := newPipeline(t, pipelineOptions{TopicPartitions: partitions})
	// The README's quick start, first.
	_, err := p.pool.Exec(ctx, `CREATE TABLE products (id bigint PRIMARY KEY, name text, version bigint NOT NULL DEFAULT 1);
		INSERT INTO products (id, name) VALUES (1, 'Anvil'), (2, 'Rocket skates')`)
	require.NoError(t, err)
	schema, err := os.ReadFile(filepath.Join(root, "schema.sql"))
	require.NoError(t, err)
	_, err = p.pool.Exec(ctx, string(schema))
	require.NoError(t, err)
	pub := p.startPublisher("LOG_LEVEL=warn")
	ix := p.startIndexer("LOG_LEVEL=warn")
	procs := func() string { return "publisher:\n" + tail(pub.Stderr(), 20) + "\nindexer:\n" + tail(ix.Stderr(), 20) }

	wrote := map[string][]printed{} // product id → what its runs printed, in order
	for _, ex := range producerExamples {
		id := ex.lang + "-1"
		for run, name := range []string{"Desk lamp (" + ex.lang + ")", "Desk lamp \"XL\" (" + ex.lang + ")"} {
			price := strconv.Itoa(1999 + run*100)
			out := runProducer(t, filepath.Join(root, ex.dir), ex.cmd, p.env(), id, name, price)
			require.Equal(t, printed{EventID: out.EventID, Topic: p.topic, ID: id, Version: int64(run + 1), Document: out.Document}, out, "%s run %d printed", ex.lang, run+1)
			// The id the examples derive (outboxrelay_event_id in SQL), not
			// one they made up: the replay protection rests on it.
			require.Equal(t, outbox.EventID("shop_products", id, int64(run+1), "app"), out.EventID, "%s run %d event id", ex.lang, run+1)
			require.JSONEq(t, `{"name":`+strconv.Quote(name)+`,"price_cents":`+price+`}`, string(out.Document), ex.lang)
			wrote[id] = append(wrote[id], out)
		}
	}

	// The index: every product at version 2 with its second document.
	waitFor(t, 2*time.Minute, "the three products at version 2 in the index", func() bool {
		docs, err := p.tryReadIndex(ctx)
		if err != nil {
			return false
		}
		for id := range wrote {
			if docs[id].Version != 2 {
				return false
			}
		}
		return true
	}, procs)
	docs := p.readIndex(ctx)
	for id, outs := range wrote {
		got, err := json.Marshal(userDoc(docs[id].Source))
		require.NoError(t, err)
		require.JSONEq(t, string(outs[1].Document), string(got), "document %s in the index", id)
	}

	// The topic: per key, the two events in version order, as the publisher
	// builds them from the rows.
	c := &kafka.Client{Addr: kafka.TCP(p.brokers...), Timeout: 30 * time.Second}
	records := map[string][]kafka.Message{}
	for part := range partitions {
		end := partitionEnd(ctx, t, c, p.topic, part)
		r := kafka.NewReader(kafka.ReaderConfig{Brokers: p.brokers, Topic: p.topic, Partition: part, MaxWait: 250 * time.Millisecond})
		for off := int64(0); off < end; {
			rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			m, err := r.ReadMessage(rctx)
			cancel()
			require.NoError(t, err, "partition %d offset %d", part, off)
			off = m.Offset + 1
			records[string(m.Key)] = append(records[string(m.Key)], m)
		}
		require.NoError(t, r.Close())
	}
	require.Len(t, records, len(wrote), "keys on the topic")
	for _, ex := range producerExamples {
		id := ex.lang + "-1"
		ms := records[id]
		require.Len(t, ms, 2, "records of %s", id)
		for i, m := range ms {
			want := wrote[id][i]
			h := map[string]string{}
			for _, kv := range m.Headers {
				h[kv.Key] = string(kv.Value)
			}
			require.Equal(t, want.EventID, h[outbox.HeaderID], "%s record %d", id, i)
			require.Equal(t, outbox.TypePrefix+outbox.TypeUpsert, h[outbox.HeaderType], id)
			require.Equal(t, strconv.FormatInt(want.Version, 10), h[outbox.HeaderAggregateVersion], "%s record %d: version order", id, i)
			require.Equal(t, "product", h[outbox.HeaderAggregateType], id)
			require.Equal(t, ex.lang, h["producer"], "%s: the example's own header", id)
			require.JSONEq(t, string(want.Document), string(m.Value), "%s record %d", id, i)
		}
	}

	// The application's table, over a new connection; the quick start's beside it.
	conn, err := pgx.Connect(ctx, p.dbURL)
	require.NoError(t, err)
	defer conn.Close(ctx)
	for id, outs := range wrote {
		var name string
		var price, version int64
		require.NoError(t, conn.QueryRow(ctx, `SELECT name, price_cents, version FROM shop_products WHERE id = $1`, id).Scan(&name, &price, &version), id)
		require.JSONEq(t, string(outs[1].Document), fmt.Sprintf(`{"name":%q,"price_cents":%d}`, name, price), "shop_products row %s", id)
		require.Equal(t, int64(2), version, "shop_products row %s", id)
	}
	rows, err := conn.Query(ctx, `SELECT id || ':' || name || ':' || version FROM products ORDER BY id`)
	require.NoError(t, err)
	quickStart, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{"1:Anvil:1", "2:Rocket skates:1"}, quickStart, "the quick start's products table")

	pubDL, ixDL := p.deadLetters(ctx)
	require.Zero(t, pubDL, "publisher dead letters\n%s", procs())
	require.Zero(t, ixDL, "indexer dead letters\n%s", procs())
}

// runProducer runs one example to its end and returns the line it printed.
func runProducer(t *testing.T, dir string, command, env []string, args ...string) printed {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, command[0], append(command[1:], args...)...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), env...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	require.NoError(t, cmd.Run(), "%v in %s\nstderr:\n%s", command, dir, stderr.String())
	var out printed
	require.NoError(t, json.Unmarshal(stdout.Bytes(), &out), "%v printed %q", command, stdout.String())
	return out
}
