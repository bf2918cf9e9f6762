//! The shared conformance suite (every scenario and the model-based test) against the real
//! server at `IDEM_MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`). Each scenario
//! runs on its own `idem_test_*` tables, dropped when the scenario's last store handle
//! goes. No server: every test fails with the command that starts one. The store keeps no
//! journal, so the journal scenarios check that it refuses journal calls.

use crate::backend;

idem_conformance::store_tests!(backend::MySql::new(), without_journal);
