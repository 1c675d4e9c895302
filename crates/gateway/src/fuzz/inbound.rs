//! The request head's target: the request-target and Host checks.

use crate::inbound;
use http::header::HeaderValue;

/// `path_host`: the request-target and Host checks. The input as a string is a path and a
/// host; their invariants are asserted (see [`check_path`] and [`check_host`]).
pub fn path_host(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    check_path(&text);
    check_host(&text);
    // A `/`-rooted variant, so that paths are reached whatever the first byte.
    check_path(&format!("/{text}"));
    check_location(&text);
}

/// What the cache makes of a `Location` naming `text` (to drop what it names): a path a
/// request could have, normalized.
pub fn check_location(text: &str) {
    let Some((path, _)) = crate::cache::resolve("/o/w", text, "gw.test") else {
        return;
    };
    assert!(path.starts_with('/'), "{text:?} → {path:?}");
    assert!(
        matches!(inbound::normalize_path(&path), Ok(None)),
        "not normal: {text:?} → {path:?}"
    );
}

/// What a normalized path must be: a fixed point of `normalize_path`, without `.` or `..`
/// segments (`;` parameters aside), empty segments, backslashes or encoded slashes; and
/// its routing path without dot-segments or empty segments.
pub fn check_path(path: &str) {
    let normal = match inbound::normalize_path(path) {
        Err(_) => return,
        Ok(None) if path == "*" => return,
        Ok(None) => path.to_string(),
        Ok(Some(n)) => {
            assert!(
                matches!(inbound::normalize_path(&n), Ok(None)),
                "not idempotent: {path:?} → {n:?} → {:?}",
                inbound::normalize_path(&n)
            );
            n
        }
    };
    assert!(normal.starts_with('/'), "{path:?} → {normal:?}");
    assert!(!normal.contains('\\'), "{path:?} → {normal:?}");
    let upper = normal.to_ascii_uppercase();
    assert!(
        !upper.contains("%2F") && !upper.contains("%5C") && !upper.contains("%00"),
        "{path:?} → {normal:?}"
    );
    for seg in normal.split('/') {
        let name = seg.split(';').next().unwrap_or(seg);
        assert!(
            name != "." && name != "..",
            "dot-segment in {normal:?} (from {path:?})"
        );
    }
    let routed = inbound::routing_path(&normal);
    for seg in routed.split('/') {
        assert!(seg != "." && seg != "..", "dot-segment routed: {normal:?}");
    }
    // A backend that drops `;` parameters merges the slashes they leave: so does routing.
    assert!(
        !routed.contains("//"),
        "empty segment routed: {normal:?} → {routed:?}"
    );
}

/// What a host `valid_host` accepts must be: ASCII, without userinfo, percent-escapes,
/// slashes, or a second `:` outside brackets; `host_only` of it valid and a fixed point.
pub fn check_host(host: &str) {
    if !inbound::valid_host(host) {
        return;
    }
    assert!(host.is_ascii(), "{host:?}");
    assert!(!host.contains(['@', '%', '/', '\\', ' ']), "{host:?}");
    let outside = match (host.find('['), host.find(']')) {
        (Some(0), Some(end)) => &host[end + 1..],
        (None, None) => host,
        _ => panic!("unbalanced brackets accepted: {host:?}"),
    };
    assert!(outside.matches(':').count() <= 1, "two colons: {host:?}");
    assert!(HeaderValue::from_str(host).is_ok(), "{host:?}");
    let only = inbound::host_only(host);
    assert!(inbound::valid_host(only), "{host:?} → {only:?}");
    assert_eq!(inbound::host_only(only), only, "{host:?}");
    assert!(!only.ends_with('.'), "{host:?} → {only:?}");
}
