//! idem-redb: work in progress.
