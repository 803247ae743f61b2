-- The demo orders table for manifest jobs: the user's table, not an
-- outboxrelay migration. A normal write bumps revision (the trigger), so an
-- order someone changed after the approval no longer matches its approved
-- revision. Idempotent.
CREATE TABLE IF NOT EXISTS orders (
    id          bigint      PRIMARY KEY,
    tenant_id   text        NOT NULL,
    revision    bigint      NOT NULL DEFAULT 1,
    status      text        NOT NULL DEFAULT 'pending',
    qty         integer     NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS orders_tenant_status ON orders (tenant_id, status);

CREATE OR REPLACE FUNCTION orders_bump_revision() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- A writer that sets the revision itself (a manifest chunk: revision + 1)
    -- keeps it; any other change gets the next revision.
    IF NEW IS DISTINCT FROM OLD AND NEW.revision = OLD.revision THEN
        NEW.revision := OLD.revision + 1;
    END IF;
    NEW.updated_at := now();
    RETURN NEW;
END $$;

DROP TRIGGER IF EXISTS orders_bump_revision ON orders;
CREATE TRIGGER orders_bump_revision BEFORE UPDATE ON orders
    FOR EACH ROW EXECUTE FUNCTION orders_bump_revision();
