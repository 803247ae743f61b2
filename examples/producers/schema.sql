-- The application's own table for the producer examples: a product whose
-- version grows by one on every write. The examples update it and insert
-- the product's outbox event in the same transaction.
CREATE TABLE IF NOT EXISTS products (
    id          text   PRIMARY KEY,
    name        text   NOT NULL,
    price_cents bigint NOT NULL,
    version     bigint NOT NULL
);
