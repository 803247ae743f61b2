// Save a product and its outbox event in one transaction (node-postgres).
//
//   DATABASE_URL=postgres://... TOPIC=shop-products node produce.js p-1 "Desk lamp" 1999
'use strict';
const { Client } = require('pg');

async function main() {
  const [id, name, price] = process.argv.slice(2);
  const priceCents = Number(price);
  const topic = process.env.TOPIC || 'shop-products';
  const client = new Client({ connectionString: process.env.DATABASE_URL });
  await client.connect();
  try {
    await client.query('BEGIN');
    // Writing the row first locks it: a concurrent writer of the same
    // product waits here, so events of one product are in version order.
    const { rows: [{ version }] } = await client.query(
      `INSERT INTO shop_products (id, name, price_cents, version) VALUES ($1, $2, $3, 1)
       ON CONFLICT (id) DO UPDATE
       SET name = excluded.name, price_cents = excluded.price_cents, version = shop_products.version + 1
       RETURNING version::text`,
      [id, name, priceCents]);
    const document = { name, price_cents: priceCents };
    const { rows: [{ event_id: eventId }] } = await client.query(
      `INSERT INTO outbox_events
           (event_id, topic, aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers)
       VALUES (outboxrelay_event_id('shop_products', $1, $2, 'app'), $3, 'product', $1, $2, 'upsert', $4, $5)
       RETURNING event_id`,
      [id, version, topic, JSON.stringify(document), JSON.stringify({ producer: 'node' })]);
    await client.query('COMMIT');
    console.log(JSON.stringify({ event_id: eventId, topic, id, version: Number(version), document }));
  } catch (err) {
    await client.query('ROLLBACK');
    throw err;
  } finally {
    await client.end();
  }
}

main().catch((err) => {
  console.error(err.message);
  process.exit(1);
});
