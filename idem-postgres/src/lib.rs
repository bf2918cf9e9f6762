//! idem-postgres: work in progress.
