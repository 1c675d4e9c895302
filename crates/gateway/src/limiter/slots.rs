//! The sub-windows every limit is counted in, on one node and across nodes alike.

/// Sub-windows per window.
pub(crate) const SUB: u64 = 10;
/// Slots kept: the current sub-window and the `SUB` before it.
pub(crate) const SLOTS: usize = SUB as usize + 1;

/// Sub-window length in nanoseconds of a window of `window_ns`.
pub(crate) fn sub_window_ns(window_ns: u64) -> u64 {
    (window_ns / SUB).max(1)
}
