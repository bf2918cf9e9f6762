-- idem-postgres migration 2: the journal of resumable handlers (steps and intents).
--
-- `{schema}` is replaced by the configured schema name, quoted, before this runs.
--
-- One row per (record, entry name). Entries live and die with their record:
-- - a sweep deletes the record and the foreign key's ON DELETE CASCADE deletes its entries
--   in the same statement;
-- - a claim that replaces an expired record keeps the row (it is an upsert, not a delete),
--   so each entry carries the `created_at` of the record generation that wrote it, and
--   every read and write of the journal joins on it: an entry whose `record_created_at` is
--   not the record's `created_at` belongs to a replaced generation and counts as absent
--   (a put overwrites it; the sweep of the record removes it). `created_at` tells
--   generations apart because a replacing claim sets it to a `now` at or after the old
--   record's `expires_at`, and an entry can only be written while `now < expires_at`.

CREATE TABLE {schema}.journal (
    -- The record's id.
    id                bytea  NOT NULL,
    -- The entry name, UTF-8 bytes (bytea so that any string, NUL included, round-trips).
    name              bytea  NOT NULL,
    -- The entry value, byte-exact.
    value             bytea  NOT NULL,
    -- `records.created_at` of the record generation that wrote the entry, ms.
    record_created_at bigint NOT NULL,
    CONSTRAINT journal_pkey PRIMARY KEY (id, name),
    CONSTRAINT journal_name_length CHECK (octet_length(name) BETWEEN 1 AND 255),
    CONSTRAINT journal_record FOREIGN KEY (id) REFERENCES {schema}.records (id) ON DELETE CASCADE
);
