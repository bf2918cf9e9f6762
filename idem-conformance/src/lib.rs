//! idem-conformance: work in progress.
