-- 020 (manifest): the approved list is frozen in the database, not only by
-- convention. manifest_items is never updated, deleted or truncated once
-- registered, and a job's approval (tenant, target, transition, topic,
-- item count, chunk size, hashes) never changes: a drain reads them on
-- every chunk, so an edit would apply values nobody approved or stop short
-- of the last items. Progress (next_index, state, conflict) stays writable;
-- verification checks it against the audit. To remove a job on purpose,
-- disable these triggers in that transaction (ALTER TABLE … DISABLE TRIGGER).
CREATE FUNCTION manifest_frozen() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_TABLE_NAME = 'manifest_jobs' THEN
        IF (NEW.job_id, NEW.tenant, NEW.spec, NEW.chunk_size, NEW.item_count, NEW.items_hash, NEW.content_hash)
           IS NOT DISTINCT FROM (OLD.job_id, OLD.tenant, OLD.spec, OLD.chunk_size, OLD.item_count, OLD.items_hash, OLD.content_hash) THEN
            RETURN NEW;
        END IF;
        RAISE EXCEPTION 'manifest job %: its approval is frozen (tenant, target, transition, items, chunk size): register a new job instead', OLD.job_id
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    RAISE EXCEPTION 'manifest_items is the frozen, approved list%: its items are never changed or removed (register a new job instead)',
        CASE WHEN TG_LEVEL = 'ROW' THEN ' of job ' || OLD.job_id ELSE '' END
        USING ERRCODE = 'integrity_constraint_violation';
END $$;

CREATE TRIGGER manifest_items_frozen BEFORE UPDATE OR DELETE ON manifest_items
    FOR EACH ROW EXECUTE FUNCTION manifest_frozen();
CREATE TRIGGER manifest_items_frozen_truncate BEFORE TRUNCATE ON manifest_items
    FOR EACH STATEMENT EXECUTE FUNCTION manifest_frozen();
CREATE TRIGGER manifest_jobs_frozen BEFORE UPDATE ON manifest_jobs
    FOR EACH ROW EXECUTE FUNCTION manifest_frozen();
