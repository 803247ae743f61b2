/*
 * Single-node Elasticsearch 7.17 from Maven Central jars, for the outboxrelay test stack:
 * the OpenSearch launcher (scripts/stack/opensearch/Launcher.java) for the org.elasticsearch
 * packages. Only the modules Maven Central publishes for 7.17 are loaded (no analysis-common,
 * no painless, no x-pack).
 *
 * The distribution's bootstrap (org.elasticsearch.bootstrap.Elasticsearch) is not used: it
 * installs the Java security manager, runs the production bootstrap checks and expects
 * the tarball's layout. Instead this class subclasses org.elasticsearch.node.Node through
 * its protected constructor that takes plugin classes (as the test framework's MockNode
 * does) and loads the modules it finds on the classpath as "classpath plugins".
 * Node's own validateNodeBeforeAcceptingRequests is a no-op, so no bootstrap checks run,
 * and no security manager is installed.
 *
 * Usage (scripts/stack/elasticsearch.sh runs it):
 *   java -cp <classes>:<libs>/* Launcher --home DIR --http-port N --transport-port N
 *        [--cluster-name NAME] [--node-name NAME] [-E key=value]...
 *
 * Layout under --home: config/log4j2.properties (written on every start), data/, logs/.
 * SIGTERM (or SIGINT) closes the node cleanly, then the JVM exits 0.
 */

import org.apache.logging.log4j.LogManager;
import org.apache.logging.log4j.core.LoggerContext;
import org.apache.logging.log4j.core.config.Configurator;
import org.elasticsearch.Version;
import org.elasticsearch.common.logging.LogConfigurator;
import org.elasticsearch.common.settings.Settings;
import org.elasticsearch.env.Environment;
import org.elasticsearch.node.InternalSettingsPreparer;
import org.elasticsearch.node.Node;
import org.elasticsearch.plugins.Plugin;

import java.io.IOException;
import java.io.PrintStream;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.util.ArrayList;
import java.util.Collection;
import java.util.Collections;
import java.util.List;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;

public final class Launcher {

    /** Module plugin classes, loaded when present on the classpath (the pom decides which are). */
    private static final String[] MODULE_PLUGINS = {
        "org.elasticsearch.transport.Netty4Plugin",                 // transport-netty4-client (HTTP)
        "org.elasticsearch.index.mapper.MapperExtrasPlugin",        // mapper-extras-client
        "org.elasticsearch.reindex.ReindexPlugin",                  // reindex-client (7.17 package)
        "org.elasticsearch.index.reindex.ReindexPlugin",            // reindex-client (older 7.x package)
    };

    private static final String LOG4J2_PROPERTIES = String.join("\n",
        "# Written by Launcher.java on every start; edits are overwritten.",
        "status = error",
        "",
        "appender.rolling.type = RollingFile",
        "appender.rolling.name = rolling",
        "appender.rolling.fileName = ${sys:es.logs.base_path}${sys:file.separator}${sys:es.logs.cluster_name}.log",
        "appender.rolling.filePattern = ${sys:es.logs.base_path}${sys:file.separator}${sys:es.logs.cluster_name}-%i.log.gz",
        "appender.rolling.layout.type = PatternLayout",
        "appender.rolling.layout.pattern = [%d{ISO8601}][%-5p][%-25c{1.}] [%node_name]%marker %m%n",
        "appender.rolling.policies.type = Policies",
        "appender.rolling.policies.size.type = SizeBasedTriggeringPolicy",
        "appender.rolling.policies.size.size = 64MB",
        "appender.rolling.strategy.type = DefaultRolloverStrategy",
        "appender.rolling.strategy.max = 2",
        "",
        "rootLogger.level = info",
        "rootLogger.appenderRef.rolling.ref = rolling",
        "",
        "# Deprecation warnings become HTTP 'Warning' response headers, as in the distribution.",
        "appender.header_warning.type = HeaderWarningAppender",
        "appender.header_warning.name = header_warning",
        "",
        "appender.deprecation.type = File",
        "appender.deprecation.name = deprecation",
        "appender.deprecation.fileName = ${sys:es.logs.base_path}${sys:file.separator}${sys:es.logs.cluster_name}_deprecation.log",
        "appender.deprecation.layout.type = PatternLayout",
        "appender.deprecation.layout.pattern = [%d{ISO8601}][%-5p][%-25c{1.}] [%node_name]%marker %m%n",
        "",
        "logger.deprecation.name = org.elasticsearch.deprecation",
        "logger.deprecation.level = warn",
        "logger.deprecation.appenderRef.deprecation.ref = deprecation",
        "logger.deprecation.appenderRef.header_warning.ref = header_warning",
        "logger.deprecation.additivity = false",
        "");

    /** Node with the module plugins given as classpath plugins (cf. MockNode). */
    static final class LauncherNode extends Node {
        LauncherNode(Environment environment, Collection<Class<? extends Plugin>> plugins) {
            super(environment, plugins, true);
        }
    }

    private static void usage(String msg) {
        System.err.println("Launcher: " + msg);
        System.err.println("usage: Launcher --home DIR --http-port N --transport-port N "
            + "[--cluster-name NAME] [--node-name NAME] [-E key=value]...");
        System.exit(2);
    }

    public static void main(String[] args) throws Exception {
        String home = null, httpPort = null, transportPort = null;
        String clusterName = "outboxrelay-test", nodeName = "outboxrelay-node-0";
        Settings.Builder extra = Settings.builder();
        for (int i = 0; i < args.length; i++) {
            String a = args[i];
            if (i + 1 >= args.length) usage("missing value after " + a);
            String v = args[++i];
            switch (a) {
                case "--home": home = v; break;
                case "--http-port": httpPort = v; break;
                case "--transport-port": transportPort = v; break;
                case "--cluster-name": clusterName = v; break;
                case "--node-name": nodeName = v; break;
                case "-E": {
                    int eq = v.indexOf('=');
                    if (eq <= 0) usage("-E wants key=value, got " + v);
                    extra.put(v.substring(0, eq), v.substring(eq + 1));
                    break;
                }
                default: usage("unknown argument " + a);
            }
        }
        if (home == null || httpPort == null || transportPort == null) {
            usage("--home, --http-port and --transport-port are required");
        }

        Path homeDir = Paths.get(home).toAbsolutePath().normalize();
        Path configDir = homeDir.resolve("config");
        Path dataDir = homeDir.resolve("data");
        Path logsDir = homeDir.resolve("logs");
        Files.createDirectories(configDir);
        Files.createDirectories(dataDir);
        Files.createDirectories(logsDir);
        Files.write(configDir.resolve("log4j2.properties"), LOG4J2_PROPERTIES.getBytes(StandardCharsets.UTF_8));

        Settings settings = Settings.builder()
            .put("cluster.name", clusterName)
            .put("node.name", nodeName)
            .put("path.home", homeDir.toString())
            .put("path.data", dataDir.toString())
            .put("path.logs", logsDir.toString())
            .put("network.host", "127.0.0.1")
            .put("http.port", httpPort)
            .put("transport.port", transportPort)
            .put("discovery.type", "single-node")
            .put("cluster.routing.allocation.disk.threshold_enabled", false)
            .put(extra.build())
            .build();

        final String finalNodeName = nodeName;
        Environment environment =
            InternalSettingsPreparer.prepareEnvironment(settings, Collections.emptyMap(), configDir, () -> finalNodeName);

        // What org.elasticsearch.bootstrap.Bootstrap does before creating the node. LogConfigurator
        // also redirects System.out/err into log4j (logger "stderr"), so keep the real stderr
        // for the one-line failure summaries that elasticsearch.sh shows.
        final PrintStream console = System.err;
        LogConfigurator.registerErrorListener();
        LogConfigurator.setNodeName(finalNodeName);
        LogConfigurator.configure(environment);

        List<Class<? extends Plugin>> plugins = new ArrayList<>();
        List<String> loaded = new ArrayList<>();
        for (String name : MODULE_PLUGINS) {
            try {
                plugins.add(Class.forName(name).asSubclass(Plugin.class));
                loaded.add(name.substring(name.lastIndexOf('.') + 1));
            } catch (ClassNotFoundException e) {
                System.err.println("Launcher: plugin not on classpath, skipped: " + name);
            }
        }
        System.err.println("Launcher: Elasticsearch " + Version.CURRENT + " on Java " + Runtime.version()
            + ", plugins " + loaded + ", home " + homeDir + ", http 127.0.0.1:" + httpPort);

        final Node node;
        try {
            node = new LauncherNode(environment, plugins);
        } catch (Throwable t) {
            LogManager.getLogger(Launcher.class).error("node construction failed", t);
            console.println("Launcher: node construction failed: " + causes(t));
            shutdownLogging();
            System.exit(1);
            return;
        }

        final CountDownLatch stopped = new CountDownLatch(1);
        Runtime.getRuntime().addShutdownHook(new Thread(() -> {
            try {
                System.err.println("Launcher: shutting down");
                node.close();
                if (!node.awaitClose(20, TimeUnit.SECONDS)) {
                    System.err.println("Launcher: node did not close within 20s");
                }
                System.err.println("Launcher: node closed");
            } catch (IOException | InterruptedException e) {
                System.err.println("Launcher: error while closing node: " + e);
            } finally {
                shutdownLogging();
                stopped.countDown();
            }
        }, "launcher-shutdown"));

        try {
            node.start();
        } catch (Throwable t) {
            LogManager.getLogger(Launcher.class).error("node start failed", t);
            console.println("Launcher: node start failed: " + causes(t));
            System.exit(1); // the shutdown hook closes what was started
        }
        System.err.println("Launcher: node started");

        // Keep the JVM alive (the node's threads are daemons) until the shutdown hook has run.
        stopped.await();
    }

    /** "A: msg; caused by B: msg; ..." on one line. */
    private static String causes(Throwable t) {
        StringBuilder sb = new StringBuilder();
        for (Throwable c = t; c != null; c = c.getCause() == c ? null : c.getCause()) {
            if (sb.length() > 0) sb.append("; caused by ");
            sb.append(c.getClass().getName()).append(": ").append(c.getMessage());
        }
        return sb.toString();
    }

    private static void shutdownLogging() {
        try {
            LoggerContext context = (LoggerContext) LogManager.getContext(false);
            Configurator.shutdown(context);
        } catch (Throwable ignored) {
            // best effort
        }
    }
}
