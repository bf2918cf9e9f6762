//! idem-redis: work in progress.
