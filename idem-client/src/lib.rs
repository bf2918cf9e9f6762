//! idem-client: work in progress.
