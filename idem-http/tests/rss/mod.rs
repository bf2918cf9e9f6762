//! Resident-memory readings of this test process, from `/proc/self/status` (Linux). Each
//! memory test is the only test in its binary, so no other test's allocations count.

/// Peak resident set since the last reset, bytes; then resets it to the current RSS
/// (`clear_refs` 5, Linux 4.0+).
pub(crate) fn take_peak() -> usize {
    let kib = status_kib("VmHWM:");
    std::fs::write("/proc/self/clear_refs", "5").expect("reset the peak (clear_refs)");
    kib * 1024
}

/// Current resident set, bytes.
pub(crate) fn current_rss() -> usize {
    status_kib("VmRSS:") * 1024
}

fn status_kib(field: &str) -> usize {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next()?.parse::<usize>().ok())
        .unwrap_or_else(|| panic!("{field} in /proc/self/status"))
}

/// Sends one keyed `POST path` through `app` and reads the body frame by frame, keeping
/// none (so the reading itself adds nothing to the RSS); returns the body's length.
pub(crate) async fn drain_post(app: &axum::Router, path: &str, key: &str) -> usize {
    use http_body_util::BodyExt;
    use tower::ServiceExt;
    let req = http::Request::post(path)
        .header("authorization", "Bearer ops")
        .header("idempotency-key", key)
        .body(axum::body::Body::empty())
        .unwrap();
    let res = app.clone().oneshot(req).await.unwrap();
    assert_eq!(res.status(), 200);
    let mut body = res.into_body();
    let mut len = 0;
    while let Some(frame) = body.frame().await {
        len += frame.unwrap().into_data().map_or(0, |d| d.len());
    }
    len
}
