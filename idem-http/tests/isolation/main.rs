//! Tenant isolation through the layer: two principals send the same key to the
//! same endpoint with the same body while the first one's record is in every row of the
//! decision table (in flight, completed, failed, mismatched, lease expired and reclaimed,
//! retention expired). The second tenant's request must run its own handler exactly once
//! and get its own answer: never the first tenant's status, headers, body, problem detail,
//! `Retry-After` or in-flight state. Run on every backend, real servers included.

#[path = "../lease/backends.rs"]
mod backends;
#[path = "../common/mod.rs"]
mod common;
#[allow(dead_code, reason = "the isolation matrix reuses the lease scenarios' clock helpers only")]
#[path = "../lease/scenarios.rs"]
mod lease;
mod scenarios;

/// The matrix of `scenarios.rs` as named tests on one backend factory.
macro_rules! isolation_tests {
    ($backend:ident) => {
        mod $backend {
            use crate::backends::$backend as factory;
            use crate::scenarios;

            /// B got A's 409/Retry-After while A's record was in flight, or B's handler did not run.
            #[tokio::test(start_paused = true)]
            async fn in_flight_record_of_one_tenant_never_blocks_the_other() {
                scenarios::in_flight(factory).await;
            }

            /// B got A's stored response replayed (status, headers, body) for the same key.
            #[tokio::test(start_paused = true)]
            async fn completed_record_of_one_tenant_is_never_replayed_to_the_other() {
                scenarios::completed(factory).await;
            }

            /// B's request reclaimed or saw A's failed record.
            #[tokio::test(start_paused = true)]
            async fn failed_record_of_one_tenant_is_never_reclaimed_by_the_other() {
                scenarios::failed(factory).await;
            }

            /// B got a mismatch because A had used the key with another body first.
            #[tokio::test(start_paused = true)]
            async fn one_tenants_fingerprint_never_makes_a_mismatch_for_the_other() {
                scenarios::mismatch(factory).await;
            }

            /// B reclaimed A's record after its lease expired, or A's retry did not.
            #[tokio::test(start_paused = true)]
            async fn expired_lease_of_one_tenant_is_reclaimed_only_by_that_tenant() {
                scenarios::reclaimed(factory).await;
            }

            /// After A's record passed its retention window, B's record and A's new one stayed apart.
            #[tokio::test(start_paused = true)]
            async fn expired_records_never_cross_tenants() {
                scenarios::expired(factory).await;
            }
        }
    };
}

isolation_tests!(memory);
isolation_tests!(redb);
isolation_tests!(sqlite);
// The real servers (127.0.0.1:6379, 127.0.0.1:5432, or IDEM_REDIS_URL / IDEM_POSTGRES_URL);
// the tests fail, never skip, when a server is down.
isolation_tests!(redis);
isolation_tests!(postgres);
