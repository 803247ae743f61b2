package io.github.outboxrelay.peers;

import java.net.URI;
import java.net.URLDecoder;
import java.nio.charset.StandardCharsets;
import java.sql.Connection;
import java.sql.DriverManager;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.sql.SQLException;
import java.sql.Statement;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.Future;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.concurrent.atomic.AtomicLong;
import java.util.concurrent.atomic.AtomicReference;

import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerConfig;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.clients.producer.RecordMetadata;
import org.apache.kafka.common.serialization.ByteArraySerializer;
import org.apache.kafka.connect.header.Header;
import org.apache.kafka.connect.source.SourceRecord;

import io.debezium.embedded.Connect;
import io.debezium.engine.DebeziumEngine;
import io.debezium.engine.RecordChangeEvent;
import io.debezium.engine.format.ChangeEventFormat;

/**
 * The Debezium peer of outboxrelay's publisher: Debezium's embedded engine
 * reads the outbox table through logical replication (pgoutput), its outbox
 * EventRouter turns each inserted row into a record (aggregate type → topic,
 * aggregate id → key, payload → value, the event id and the chosen columns
 * → headers), and a Kafka producer sends each batch with acks=all before the
 * engine may commit its offsets, the way Debezium Server's Kafka sink does.
 *
 * <p>Commands (see README.md beside the pom):
 * <ul>
 *   <li>{@code setup}: create the publication (inserts only, via the
 *       partition root, since outbox_events is hash-partitioned) and the
 *       replication slot when missing, then exit. Rows committed after it are
 *       streamed by the next {@code run}, whenever it starts.</li>
 *   <li>{@code run}: {@code setup}, then stream until SIGTERM/SIGINT.</li>
 * </ul>
 */
public final class DebeziumPeer {

    private DebeziumPeer() {
    }

    /** The command line, parsed: one flag per setting, repeatable --set and --producer. */
    static final class Options {
        String command;
        String databaseUrl = System.getenv().getOrDefault("DATABASE_URL", "");
        String brokers = System.getenv().getOrDefault("KAFKA_BROKERS", "");
        String slot = "outboxrelay_debezium";
        String publication = "outboxrelay_debezium";
        String table = "public.outbox_events";
        String routeBy = "aggregate_type";
        String offsets = "";
        int statsSeconds = 0;
        final Map<String, String> engine = new LinkedHashMap<>();
        final Map<String, String> producer = new LinkedHashMap<>();
    }

    static final String USAGE = String.join("\n",
            "usage: debezium-peer setup|run [flags]",
            "  --database-url URL    postgres://user:pass@host:port/db (env DATABASE_URL; required)",
            "  --brokers HOSTS       Kafka bootstrap servers, comma-separated (env KAFKA_BROKERS; run: required)",
            "  --slot NAME           replication slot (default outboxrelay_debezium)",
            "  --publication NAME    publication (default outboxrelay_debezium)",
            "  --table NAME          outbox table, schema.table (default public.outbox_events)",
            "  --route-by COLUMN     column whose value is the topic (default aggregate_type)",
            "  --offsets FILE        Debezium's offset file (run: required)",
            "  --stats SECONDS       print a stats line every SECONDS to stdout (default 0: off)",
            "  --set KEY=VALUE       any Debezium engine/connector property, e.g. poll.interval.ms=10 (repeatable)",
            "  --producer KEY=VALUE  any Kafka producer property, e.g. linger.ms=0 (repeatable)");

    static Options parse(String[] args) {
        Options o = new Options();
        if (args.length == 0) {
            throw new IllegalArgumentException("no command");
        }
        o.command = args[0];
        for (int i = 1; i < args.length; i++) {
            String flag = args[i];
            if (flag.equals("-h") || flag.equals("--help")) {
                System.out.println(USAGE);
                System.exit(0);
            }
            if (i + 1 >= args.length) {
                throw new IllegalArgumentException(flag + " needs a value");
            }
            String v = args[++i];
            switch (flag) {
                case "--database-url" -> o.databaseUrl = v;
                case "--brokers" -> o.brokers = v;
                case "--slot" -> o.slot = v;
                case "--publication" -> o.publication = v;
                case "--table" -> o.table = v;
                case "--route-by" -> o.routeBy = v;
                case "--offsets" -> o.offsets = v;
                case "--stats" -> o.statsSeconds = Integer.parseInt(v);
                case "--set" -> put(o.engine, flag, v);
                case "--producer" -> put(o.producer, flag, v);
                default -> throw new IllegalArgumentException("unknown flag " + flag);
            }
        }
        if (!o.command.equals("setup") && !o.command.equals("run")) {
            throw new IllegalArgumentException("unknown command " + o.command);
        }
        if (o.databaseUrl.isEmpty()) {
            throw new IllegalArgumentException("--database-url (DATABASE_URL) is required");
        }
        if (o.command.equals("run") && o.brokers.isEmpty()) {
            throw new IllegalArgumentException("--brokers (KAFKA_BROKERS) is required");
        }
        if (o.command.equals("run") && o.offsets.isEmpty()) {
            throw new IllegalArgumentException("--offsets is required");
        }
        if (!o.table.contains(".")) {
            throw new IllegalArgumentException("--table " + o.table + ": want schema.table");
        }
        return o;
    }

    private static void put(Map<String, String> m, String flag, String kv) {
        int eq = kv.indexOf('=');
        if (eq <= 0) {
            throw new IllegalArgumentException(flag + " " + kv + ": want KEY=VALUE");
        }
        m.put(kv.substring(0, eq), kv.substring(eq + 1));
    }

    /** A postgres:// URL split into what JDBC and Debezium take. */
    record Database(String host, int port, String user, String password, String name, String sslmode) {
        static Database parse(String url) {
            URI u = URI.create(url);
            if (!"postgres".equals(u.getScheme()) && !"postgresql".equals(u.getScheme())) {
                throw new IllegalArgumentException("--database-url " + redact(url) + ": want postgres://");
            }
            String user = "postgres";
            String password = "";
            if (u.getRawUserInfo() != null) {
                String[] up = u.getRawUserInfo().split(":", 2);
                user = decode(up[0]);
                password = up.length > 1 ? decode(up[1]) : "";
            }
            String sslmode = "disable";
            if (u.getRawQuery() != null) {
                for (String kv : u.getRawQuery().split("&")) {
                    if (kv.startsWith("sslmode=")) {
                        sslmode = decode(kv.substring("sslmode=".length()));
                    }
                }
            }
            String name = u.getPath() == null || u.getPath().length() <= 1 ? user : u.getPath().substring(1);
            return new Database(u.getHost(), u.getPort() > 0 ? u.getPort() : 5432, user, password, name, sslmode);
        }

        String jdbc() {
            return "jdbc:postgresql://" + host + ":" + port + "/" + name + "?sslmode=" + sslmode;
        }

        Connection connect() throws SQLException {
            Properties p = new Properties();
            p.setProperty("user", user);
            p.setProperty("password", password);
            return DriverManager.getConnection(jdbc(), p);
        }
    }

    private static String decode(String s) {
        return URLDecoder.decode(s, StandardCharsets.UTF_8);
    }

    static String redact(String url) {
        return url.replaceAll("://([^:/@]*):[^@]*@", "://$1:xxxxx@");
    }

    /**
     * Creates the publication and the slot when missing. outbox_events is
     * partitioned by hash: without publish_via_partition_root the changes
     * would carry the partitions' names (outbox_events_s00 …) and match no
     * table Debezium was told to read. Only inserts are published: the
     * outbox is append-only for its readers, and deletes (the publisher's,
     * a retention sweep's) are no events.
     */
    static void setup(Options o) throws SQLException {
        Database db = Database.parse(o.databaseUrl);
        String[] st = o.table.split("\\.", 2);
        try (Connection c = db.connect()) {
            boolean havePub;
            try (PreparedStatement ps = c.prepareStatement("SELECT 1 FROM pg_publication WHERE pubname = ?")) {
                ps.setString(1, o.publication);
                try (ResultSet rs = ps.executeQuery()) {
                    havePub = rs.next();
                }
            }
            if (!havePub) {
                try (Statement s = c.createStatement()) {
                    s.execute("CREATE PUBLICATION " + ident(o.publication) + " FOR TABLE " + ident(st[0]) + "." + ident(st[1])
                            + " WITH (publish = 'insert', publish_via_partition_root = true)");
                }
            }
            boolean haveSlot;
            try (PreparedStatement ps = c.prepareStatement("SELECT 1 FROM pg_replication_slots WHERE slot_name = ?")) {
                ps.setString(1, o.slot);
                try (ResultSet rs = ps.executeQuery()) {
                    haveSlot = rs.next();
                }
            }
            if (!haveSlot) {
                try (PreparedStatement ps = c.prepareStatement("SELECT pg_create_logical_replication_slot(?, 'pgoutput')")) {
                    ps.setString(1, o.slot);
                    ps.executeQuery().close();
                }
            }
        }
    }

    /** A quoted SQL identifier. */
    static String ident(String s) {
        return "\"" + s.replace("\"", "\"\"") + "\"";
    }

    /** The engine's properties: the connector, the EventRouter, then the --set overrides. */
    static Properties engineProperties(Options o) {
        Database db = Database.parse(o.databaseUrl);
        Properties p = new Properties();
        p.setProperty("name", "outboxrelay-debezium-peer");
        p.setProperty("connector.class", "io.debezium.connector.postgresql.PostgresConnector");
        p.setProperty("offset.storage", "org.apache.kafka.connect.storage.FileOffsetBackingStore");
        p.setProperty("offset.storage.file.filename", o.offsets);
        p.setProperty("offset.flush.interval.ms", "1000");
        p.setProperty("database.hostname", db.host());
        p.setProperty("database.port", Integer.toString(db.port()));
        p.setProperty("database.user", db.user());
        p.setProperty("database.password", db.password());
        p.setProperty("database.dbname", db.name());
        p.setProperty("database.sslmode", db.sslmode());
        p.setProperty("topic.prefix", "outboxrelay-peer");
        p.setProperty("plugin.name", "pgoutput");
        p.setProperty("slot.name", o.slot);
        p.setProperty("publication.name", o.publication);
        p.setProperty("publication.autocreate.mode", "disabled");
        p.setProperty("table.include.list", o.table);
        // xid8 has no Debezium converter (it would warn on every schema
        // refresh), and the EventRouter needs no more than the row's event.
        p.setProperty("column.exclude.list", o.table + ".xact_id");
        // The slot made by setup marks where streaming starts; the rows
        // already in the table before it are not events to send again.
        p.setProperty("snapshot.mode", "no_data");
        p.setProperty("transforms", "outbox");
        p.setProperty("transforms.outbox.type", "io.debezium.transforms.outbox.EventRouter");
        p.setProperty("transforms.outbox.table.field.event.id", "event_id");
        p.setProperty("transforms.outbox.table.field.event.key", "aggregate_id");
        p.setProperty("transforms.outbox.table.field.event.payload", "payload");
        p.setProperty("transforms.outbox.route.by.field", o.routeBy);
        p.setProperty("transforms.outbox.route.topic.replacement", "${routedByValue}");
        p.setProperty("transforms.outbox.table.fields.additional.placement",
                "event_type:header:event_type,aggregate_version:header:aggregate_version,aggregate_type:header:aggregate_type");
        o.engine.forEach(p::setProperty);
        return p;
    }

    static Properties producerProperties(Options o) {
        Properties p = new Properties();
        p.setProperty(ProducerConfig.BOOTSTRAP_SERVERS_CONFIG, o.brokers);
        p.setProperty(ProducerConfig.ACKS_CONFIG, "all");
        p.setProperty(ProducerConfig.KEY_SERIALIZER_CLASS_CONFIG, ByteArraySerializer.class.getName());
        p.setProperty(ProducerConfig.VALUE_SERIALIZER_CLASS_CONFIG, ByteArraySerializer.class.getName());
        p.setProperty(ProducerConfig.CLIENT_ID_CONFIG, "outboxrelay-debezium-peer");
        o.producer.forEach(p::setProperty);
        return p;
    }

    /** Bytes of a key, value or header value as the EventRouter leaves it. */
    static byte[] bytes(Object v) {
        if (v == null) {
            return null;
        }
        if (v instanceof byte[] b) {
            return b;
        }
        if (v instanceof java.nio.ByteBuffer bb) {
            byte[] b = new byte[bb.remaining()];
            bb.duplicate().get(b);
            return b;
        }
        return v.toString().getBytes(StandardCharsets.UTF_8);
    }

    /**
     * Sends each batch and waits for every acknowledgement before marking
     * it processed: the engine commits offsets (and so lets PostgreSQL drop
     * the WAL) only for records the broker has. A failed send fails the
     * batch, and the engine stops; its offsets stay where the last whole
     * batch ended, so a restart sends the rest again (at-least-once).
     */
    static final class Sink implements DebeziumEngine.ChangeConsumer<RecordChangeEvent<SourceRecord>> {
        private final KafkaProducer<byte[], byte[]> producer;
        final AtomicLong sent = new AtomicLong();
        final AtomicLong batches = new AtomicLong();

        Sink(KafkaProducer<byte[], byte[]> producer) {
            this.producer = producer;
        }

        @Override
        public void handleBatch(List<RecordChangeEvent<SourceRecord>> records,
                DebeziumEngine.RecordCommitter<RecordChangeEvent<SourceRecord>> committer) throws InterruptedException {
            List<Future<RecordMetadata>> acks = new ArrayList<>(records.size());
            for (RecordChangeEvent<SourceRecord> e : records) {
                SourceRecord r = e.record();
                ProducerRecord<byte[], byte[]> pr = new ProducerRecord<>(r.topic(), null, bytes(r.key()), bytes(r.value()));
                for (Header h : r.headers()) {
                    pr.headers().add(h.key(), bytes(h.value()));
                }
                acks.add(producer.send(pr));
            }
            for (Future<RecordMetadata> f : acks) {
                try {
                    f.get();
                } catch (java.util.concurrent.ExecutionException ex) {
                    throw new DebeziumException("send to Kafka: " + ex.getCause().getMessage(), ex.getCause());
                }
            }
            for (RecordChangeEvent<SourceRecord> e : records) {
                committer.markProcessed(e);
            }
            committer.markBatchFinished();
            sent.addAndGet(records.size());
            batches.incrementAndGet();
        }
    }

    /** An unchecked error the engine reports through its completion callback. */
    static final class DebeziumException extends RuntimeException {
        DebeziumException(String message, Throwable cause) {
            super(message, cause);
        }
    }

    public static void main(String[] args) throws Exception {
        // Quiet by default; -Dorg.slf4j.simpleLogger.defaultLogLevel=info to see more.
        System.setProperty("org.slf4j.simpleLogger.defaultLogLevel",
                System.getProperty("org.slf4j.simpleLogger.defaultLogLevel", "warn"));
        System.setProperty("org.slf4j.simpleLogger.showDateTime", "true");
        Options o;
        try {
            o = parse(args);
        } catch (IllegalArgumentException e) {
            System.err.println("debezium-peer: " + e.getMessage());
            System.err.println(USAGE);
            System.exit(2);
            return;
        }
        setup(o);
        if (o.command.equals("setup")) {
            System.out.println("setup slot=" + o.slot + " publication=" + o.publication);
            return;
        }
        System.exit(run(o));
    }

    static int run(Options o) throws InterruptedException {
        KafkaProducer<byte[], byte[]> producer = new KafkaProducer<>(producerProperties(o));
        Sink sink = new Sink(producer);
        AtomicReference<Throwable> failure = new AtomicReference<>();
        AtomicInteger exit = new AtomicInteger();
        CountDownLatch finished = new CountDownLatch(1);
        DebeziumEngine<RecordChangeEvent<SourceRecord>> engine = DebeziumEngine.create(ChangeEventFormat.of(Connect.class))
                .using(engineProperties(o))
                .using(new DebeziumEngine.ConnectorCallback() {
                    @Override
                    public void taskStarted() {
                        System.out.println("started");
                        System.out.flush();
                    }
                })
                .using((success, message, error) -> {
                    if (!success) {
                        failure.set(error);
                        System.err.println("debezium-peer: engine stopped: " + message + (error != null ? ": " + error : ""));
                        exit.set(1);
                    }
                    finished.countDown();
                })
                .notifying(sink)
                .build();
        ExecutorService pool = Executors.newSingleThreadExecutor();
        pool.execute(engine);
        // SIGTERM/SIGINT stop the engine (it finishes the batch in flight
        // and commits its offsets), then main returns 0. A JVM left to its
        // default handler would exit 143 from inside its shutdown hooks.
        sun.misc.SignalHandler stopEngine = sig -> new Thread(() -> {
            try {
                engine.close();
            } catch (Exception e) {
                System.err.println("debezium-peer: close: " + e);
            }
        }, "stop").start();
        sun.misc.Signal.handle(new sun.misc.Signal("TERM"), stopEngine);
        sun.misc.Signal.handle(new sun.misc.Signal("INT"), stopEngine);
        if (o.statsSeconds > 0) {
            Thread stats = new Thread(() -> {
                try {
                    while (finished.getCount() > 0) {
                        Thread.sleep(o.statsSeconds * 1000L);
                        System.out.println("stats sent=" + sink.sent.get() + " batches=" + sink.batches.get());
                        System.out.flush();
                    }
                } catch (InterruptedException e) {
                    Thread.currentThread().interrupt();
                }
            }, "stats");
            stats.setDaemon(true);
            stats.start();
        }
        finished.await();
        pool.shutdown();
        producer.close(java.time.Duration.ofSeconds(10));
        System.out.println("stopped sent=" + sink.sent.get());
        System.out.flush();
        return exit.get();
    }
}
