"""Save a product and its outbox event in one transaction (psycopg 3).

    DATABASE_URL=postgres://... TOPIC=shop-products python3 produce.py p-1 "Desk lamp" 1999
"""
import json
import os
import sys

import psycopg

product_id, name, price_cents = sys.argv[1], sys.argv[2], int(sys.argv[3])
topic = os.environ.get("TOPIC", "shop-products")

with psycopg.connect(os.environ["DATABASE_URL"]) as conn:
    with conn.transaction():  # commits at the end of the block, rolls back on an error
        # Writing the row first locks it: a concurrent writer of the same
        # product waits here, so events of one product are in version order.
        version = conn.execute(
            """INSERT INTO shop_products (id, name, price_cents, version) VALUES (%s, %s, %s, 1)
               ON CONFLICT (id) DO UPDATE
               SET name = excluded.name, price_cents = excluded.price_cents, version = shop_products.version + 1
               RETURNING version""",
            (product_id, name, price_cents),
        ).fetchone()[0]
        document = {"name": name, "price_cents": price_cents}
        event_id = conn.execute(
            """INSERT INTO outbox_events
                   (event_id, topic, aggregate_type, aggregate_id, aggregate_version, event_type, payload, headers)
               VALUES (outboxrelay_event_id('shop_products', %s, %s, 'app'), %s, 'product', %s, %s, 'upsert', %s, %s)
               RETURNING event_id""",
            (product_id, version, topic, product_id, version,
             json.dumps(document), json.dumps({"producer": "python"})),
        ).fetchone()[0]

print(json.dumps({"event_id": str(event_id), "topic": topic, "id": product_id,
                  "version": version, "document": document}))
