//! The `Date` header of answers, formatted once a second per thread.

use std::cell::RefCell;

thread_local! {
    /// The `Date` value of the current second, formatted once per second per thread.
    static DATE: RefCell<(u64, [u8; 29])> = const { RefCell::new((0, [b' '; 29])) };
}

/// Calls `f` with the current `Date` header value (IMF-fixdate, 29 bytes).
pub fn with_date<T>(f: impl FnOnce(&[u8]) -> T) -> T {
    let now = crate::clock::coarse::wall();
    let secs = now
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    DATE.with(|d| {
        let mut d = d.borrow_mut();
        if d.0 != secs {
            let s = httpdate::fmt_http_date(now);
            if s.len() == 29 {
                d.1.copy_from_slice(s.as_bytes());
                d.0 = secs;
            }
        }
        f(&d.1)
    })
}
