-- idem-postgres migration 1: the records table and its three indices.
--
-- `{schema}` is replaced by the configured schema name, quoted, before this runs.
-- Times are UTC milliseconds since the Unix epoch (bigint), the unit of the whole crate,
-- so that no comparison mixes seconds and milliseconds.

CREATE TABLE {schema}.records (
    -- BLAKE3 record id over (principal, endpoint, key): the scope key.
    id               bytea  NOT NULL,
    -- UTF-8 bytes; bytea rather than text so that any string (NUL included) round-trips
    -- whatever the database encoding.
    principal        bytea  NOT NULL,
    endpoint         bytea  NOT NULL,
    -- The idempotency key: visible ASCII only.
    key              text   NOT NULL,
    fingerprint      bytea  NOT NULL,
    state            text   NOT NULL,
    -- Fencing token: grows by one on every claim of the record.
    token            bigint NOT NULL,
    -- Version byte + postcard of the stored response; set exactly when completed.
    response         bytea,
    created_at       bigint NOT NULL,
    started_at       bigint NOT NULL,
    lease_expires_at bigint NOT NULL,
    expires_at       bigint NOT NULL,
    -- The transaction that created (or replaced) the row by a claim. The claim statement
    -- compares it with its own txid_current() to tell "this call claimed" from "this call
    -- found a live record": RETURNING cannot see the row as it was before the upsert.
    claim_txid       bigint NOT NULL,
    CONSTRAINT records_pkey PRIMARY KEY (id),
    CONSTRAINT records_id_length CHECK (octet_length(id) = 32),
    CONSTRAINT records_fingerprint_length CHECK (octet_length(fingerprint) = 32),
    CONSTRAINT records_state CHECK (state IN ('in_flight', 'completed', 'failed')),
    CONSTRAINT records_response_iff_completed CHECK ((state = 'completed') = (response IS NOT NULL)),
    CONSTRAINT records_token_positive CHECK (token >= 1)
);

-- The sweep walks expired records oldest first.
CREATE INDEX records_expires_at ON {schema}.records (expires_at);

-- Live claims by lease end: what an operator (or a future reaper) asks for when looking
-- for stuck handlers. Partial, so completed and failed records cost nothing here.
CREATE INDEX records_in_flight_lease ON {schema}.records (lease_expires_at) WHERE state = 'in_flight';
