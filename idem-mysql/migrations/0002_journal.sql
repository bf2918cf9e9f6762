-- idem-mysql migration 2: the journal of resumable handlers (steps and intents).
--
-- `{prefix}` is replaced by the configured table prefix before this runs. One row per
-- (record, entry name). Entries live and die with their record generation:
-- - a sweep deletes the record's entries and then the record, in one transaction, holding
--   the record's row lock. No foreign key: it would make the records table impossible to
--   drop without this one (tools and tests drop `<prefix>_records` on its own), and the
--   sweep already removes entries with their record;
-- - a claim that replaces an expired record keeps the row (an UPDATE, not a delete), so
--   it deletes the old generation's entries itself, in its transaction, under the
--   record's row lock.
-- Every journal write holds the record's row lock, so entries of one record are never
-- written concurrently.
CREATE TABLE IF NOT EXISTS `{prefix}_journal` (
    -- The record's id.
    id    BINARY(32)     NOT NULL,
    -- The entry name, UTF-8 bytes (binary so that any string round-trips), 1..=255 bytes.
    name  VARBINARY(255) NOT NULL,
    -- The entry value, byte-exact.
    value LONGBLOB       NOT NULL,
    PRIMARY KEY (id, name)
) ENGINE = InnoDB
