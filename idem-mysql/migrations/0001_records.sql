-- idem-mysql migration 1: the records table and its expiry index.
--
-- `{prefix}` is replaced by the configured table prefix before this runs. Runs the same on
-- MySQL 8 and MariaDB 10.11. DDL commits implicitly on both, so the statement is written
-- to be run again (IF NOT EXISTS) after a crash between it and its bookkeeping row.
-- Times are UTC milliseconds since the Unix epoch (BIGINT), the unit of the whole crate.
CREATE TABLE IF NOT EXISTS `{prefix}_records` (
    -- BLAKE3 record id over (principal, endpoint, key): the scope key.
    id               BINARY(32)     NOT NULL,
    -- UTF-8 bytes; binary so that any string round-trips whatever the table's charset.
    principal        LONGBLOB       NOT NULL,
    endpoint         LONGBLOB       NOT NULL,
    -- The idempotency key: visible ASCII, at most 255 bytes. `key` is a reserved word.
    idem_key         VARBINARY(255) NOT NULL,
    fingerprint      BINARY(32)     NOT NULL,
    state            VARCHAR(16)    CHARACTER SET ascii NOT NULL,
    -- Fencing token: grows by one on every claim of the record.
    token            BIGINT         NOT NULL,
    -- Version byte + postcard of the stored response; set exactly when completed.
    response         LONGBLOB       NULL,
    created_at       BIGINT         NOT NULL,
    started_at       BIGINT         NOT NULL,
    lease_expires_at BIGINT         NOT NULL,
    expires_at       BIGINT         NOT NULL,
    PRIMARY KEY (id),
    -- The sweep deletes expired records oldest first through this index.
    KEY `{prefix}_records_expires_at` (expires_at),
    CONSTRAINT `{prefix}_records_state` CHECK (state IN ('in_flight', 'completed', 'failed')),
    CONSTRAINT `{prefix}_records_response` CHECK ((state = 'completed') = (response IS NOT NULL)),
    CONSTRAINT `{prefix}_records_token_positive` CHECK (token >= 1)
) ENGINE = InnoDB
