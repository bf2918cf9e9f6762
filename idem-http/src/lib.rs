//! idem-http: work in progress.
