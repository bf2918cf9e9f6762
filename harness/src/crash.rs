//! The crash points of the demo's create handler (`leasebroker::app`), which `serve
//! --crash-at` arms ([`leasebroker::crash::CrashPlan`]) and `tests/crash.rs` kills the
//! server at with SIGKILL, in the order a create request passes them.

/// The create handler's crash points, in order.
pub const POINTS: [&str; 8] = [
    // Claimed, nothing done yet.
    "before_allocate",
    // The node is allocated (and journalled); no lease.
    "after_allocate",
    // The lease is written (and journalled); the boot intent is not yet recorded.
    "after_lease",
    // The boot intent is journalled `pending`; the hypervisor has not been called.
    "before_boot",
    // The hypervisor booted the VM; the intent is still `pending` (only reconcile can tell).
    "after_boot",
    // The intent is `done(vm)`; no worker row.
    "after_boot_recorded",
    // The worker row is written; the response is not stored.
    "after_worker",
    // The response is stored (the record completed); it never reaches the client.
    "after_completion",
];
