//! leasebroker: work in progress.
