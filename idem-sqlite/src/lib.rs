//! idem-sqlite: work in progress.
