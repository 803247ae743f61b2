-- The application's own table for the producer examples: a product whose
-- version grows by one on every write. The examples update it and insert
-- the product's outbox event in the same transaction.
--
-- Its name is the examples' own, not the README quick start's `products`
-- (bigint ids), so both fit in one database. No IF NOT EXISTS: if a table of
-- this name already exists, this fails loudly ("relation ... already exists")
-- rather than keeping a table of another shape the examples cannot write.
CREATE TABLE shop_products (
    id          text   PRIMARY KEY,
    name        text   NOT NULL,
    price_cents bigint NOT NULL,
    version     bigint NOT NULL
);
