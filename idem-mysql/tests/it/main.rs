//! Every integration test of this crate in one binary (one link on two cores, not one per
//! file); one module per area. They need a live MySQL or MariaDB (`IDEM_MYSQL_URL`,
//! default `mysql://root@127.0.0.1:3306/test`) and fail, never skip, without one.

mod backend;
mod common;
mod complete_in;
mod conformance;
mod mysql;
