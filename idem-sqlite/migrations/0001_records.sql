-- idem-sqlite schema version 1: one table of idempotency records.
--
-- All times are UTC milliseconds since the Unix epoch (INTEGER), one unit everywhere.
-- A record is gone once now >= expires_at; an in-flight lease is fresh
-- while now < lease_expires_at.

CREATE TABLE idem_records (
    -- BLAKE3 record id over (principal, endpoint, key): 32 bytes.
    id               BLOB    NOT NULL PRIMARY KEY CHECK (length(id) = 32),
    principal        TEXT    NOT NULL,
    endpoint         TEXT    NOT NULL,
    -- The idempotency key as the client meant it (unquoted, visible ASCII).
    key              TEXT    NOT NULL,
    -- BLAKE3 request fingerprint: 32 bytes.
    fingerprint      BLOB    NOT NULL CHECK (length(fingerprint) = 32),
    state            TEXT    NOT NULL CHECK (state IN ('in_flight', 'completed', 'failed')),
    -- Fencing token: grows by one on every claim and reclaim.
    token            INTEGER NOT NULL CHECK (token >= 1),
    created_at       INTEGER NOT NULL,
    started_at       INTEGER NOT NULL,
    lease_expires_at INTEGER NOT NULL,
    expires_at       INTEGER NOT NULL,
    -- The stored response (format byte 1, then postcard); present exactly when completed.
    response         BLOB,
    CHECK ((state = 'completed') = (response IS NOT NULL))
);

-- The scope key: look up or list a scope's records by (principal, endpoint, key).
CREATE INDEX idem_records_scope ON idem_records (principal, endpoint, key);

-- The sweep: oldest expired records first, bounded by LIMIT.
CREATE INDEX idem_records_expires ON idem_records (expires_at);

-- The in-flight lease: find claims whose lease has run out (stuck handlers).
CREATE INDEX idem_records_lease ON idem_records (lease_expires_at) WHERE state = 'in_flight';
