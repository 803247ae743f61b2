-- 011: a row the sweep tombstoned can come back with an old version.
--
-- The sweep of a full run writes a vanished row's tombstone at the last
-- normalized version + 1 (what the index's external versioning needs to
-- take the delete). A row inserted again with the same id and a version
-- at or below the tombstone's (the version column reset, a restore from a
-- backup) must still win over it: the scan then writes it at the
-- tombstone's version + 1 and remembers the difference to the source's
-- version in version_offset, so the row's later changes (source version +
-- offset) keep growing past it. normalized_records.source_version is the
-- version the index holds (events' aggregate_version); source_version -
-- version_offset is the source row's own. vanished marks a tombstone the
-- sweep wrote (the source row was gone), as opposed to a soft delete the
-- source itself versioned.
--
-- Adding columns with constant defaults rewrites nothing.
ALTER TABLE normalized_records
    ADD COLUMN version_offset bigint  NOT NULL DEFAULT 0,
    ADD COLUMN vanished       boolean NOT NULL DEFAULT false;
