-- idem-sqlite schema version 2: the per-record journal of resumable handlers (a step's
-- stored result, an intent's state), keyed by (record id, entry name).
--
-- Entries live and die with their record: deleting a record (the sweep) deletes its
-- entries through the trigger below, and a claim that replaces an expired record deletes
-- them explicitly before it writes. A reclaim keeps them: that is how a retry resumes.

CREATE TABLE idem_journal (
    record_id BLOB NOT NULL,
    -- The entry's name, e.g. a step name (1..=255 bytes).
    name      TEXT NOT NULL,
    -- The entry's bytes, opaque to the store.
    value     BLOB NOT NULL,
    PRIMARY KEY (record_id, name)
);

CREATE TRIGGER idem_records_delete_journal AFTER DELETE ON idem_records
BEGIN
    DELETE FROM idem_journal WHERE record_id = OLD.id;
END;
