package example;

import java.net.URI;
import java.net.URLDecoder;
import java.nio.charset.StandardCharsets;
import java.sql.Connection;
import java.sql.DriverManager;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.sql.SQLException;
import java.util.Properties;

/**
 * Saves a product and its outbox event in one transaction (JDBC).
 *
 * <pre>DATABASE_URL=postgres://... TOPIC=shop-products java -jar target/produce.jar p-1 "Desk lamp" 1999</pre>
 */
public final class Produce {
    public static void main(String[] args) throws SQLException {
        String id = args[0], name = args[1];
        long priceCents = Long.parseLong(args[2]);
        String topic = System.getenv().getOrDefault("TOPIC", "shop-products");
        Properties props = new Properties();
        String url = jdbcUrl(System.getenv("DATABASE_URL"), props);

        try (Connection conn = DriverManager.getConnection(url, props)) {
            conn.setAutoCommit(false); // one transaction for the row and its event
            try {
                // Writing the row first locks it: a concurrent writer of the same
                // product waits here, so events of one product are in version order.
                long version;
                try (PreparedStatement st = conn.prepareStatement(
                        "INSERT INTO shop_products (id, name, price_cents, version) VALUES (?, ?, ?, 1) "
                                + "ON CONFLICT (id) DO UPDATE SET name = excluded.name, "
                                + "price_cents = excluded.price_cents, version = shop_products.version + 1 "
                                + "RETURNING version")) {
                    st.setString(1, id);
                    st.setString(2, name);
                    st.setLong(3, priceCents);
                    version = single(st.executeQuery()).getLong(1);
                }
                String document = "{\"name\":" + jsonString(name) + ",\"price_cents\":" + priceCents + "}";
                String eventId;
                try (PreparedStatement st = conn.prepareStatement(
                        "INSERT INTO outbox_events (event_id, topic, aggregate_type, aggregate_id, "
                                + "aggregate_version, event_type, payload, headers) "
                                + "VALUES (outboxrelay_event_id('shop_products', ?, ?, 'app'), ?, 'product', ?, ?, "
                                + "'upsert', ?::json, ?::jsonb) RETURNING event_id")) {
                    st.setString(1, id);
                    st.setLong(2, version);
                    st.setString(3, topic);
                    st.setString(4, id);
                    st.setLong(5, version);
                    st.setString(6, document);
                    st.setString(7, "{\"producer\":\"java\"}");
                    eventId = single(st.executeQuery()).getString(1);
                }
                conn.commit();
                System.out.printf("{\"event_id\":\"%s\",\"topic\":%s,\"id\":%s,\"version\":%d,\"document\":%s}%n",
                        eventId, jsonString(topic), jsonString(id), version, document);
            } catch (SQLException e) {
                conn.rollback();
                throw e;
            }
        }
    }

    private static ResultSet single(ResultSet rs) throws SQLException {
        if (!rs.next()) {
            throw new SQLException("no row returned");
        }
        return rs;
    }

    /**
     * Turns a libpq URL (postgres://user:password@host:port/db?sslmode=...) into a
     * JDBC URL, moving the user and password into props; a jdbc: URL is used as is.
     */
    static String jdbcUrl(String url, Properties props) {
        if (url == null || url.isEmpty()) {
            throw new IllegalArgumentException("DATABASE_URL is not set");
        }
        if (url.startsWith("jdbc:")) {
            return url;
        }
        URI u = URI.create(url);
        if (u.getRawUserInfo() != null) {
            String[] userInfo = u.getRawUserInfo().split(":", 2);
            props.setProperty("user", decode(userInfo[0]));
            if (userInfo.length == 2) {
                props.setProperty("password", decode(userInfo[1]));
            }
        }
        String hostPort = u.getHost() + (u.getPort() == -1 ? "" : ":" + u.getPort());
        String query = u.getRawQuery() == null ? "" : "?" + u.getRawQuery();
        return "jdbc:postgresql://" + hostPort + u.getRawPath() + query;
    }

    private static String decode(String s) {
        return URLDecoder.decode(s, StandardCharsets.UTF_8);
    }

    /** A JSON string literal: enough escaping for this example's text fields. */
    private static String jsonString(String s) {
        StringBuilder b = new StringBuilder("\"");
        for (char c : s.toCharArray()) {
            switch (c) {
                case '"' -> b.append("\\\"");
                case '\\' -> b.append("\\\\");
                default -> {
                    if (c < 0x20) {
                        b.append(String.format("\\u%04x", (int) c));
                    } else {
                        b.append(c);
                    }
                }
            }
        }
        return b.append('"').toString();
    }
}
