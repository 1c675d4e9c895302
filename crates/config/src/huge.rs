//! Large per-consumer arrays in 2 MiB pages where the kernel offers them.
//!
//! With a million consumers, the key table (≈ 20 MB) and the counters' lines (≈ 64 MB) are
//! read at random: a request for a consumer not in the CPU's caches misses both, and on
//! 4 KiB pages each miss also walks the page tables (two-dimensional in a virtual machine).
//! Asking for transparent huge pages on those two arrays, before they are written, takes
//! most of the page walks away at no memory cost beyond rounding to 2 MiB. Measured in
//! `bench/scale_ab.py` (see docs/benchmarks.md, "A million consumers").
//!
//! It is advice only: where transparent huge pages are off (`never` in
//! `/sys/kernel/mm/transparent_hugepage/enabled`) or on other systems, nothing changes.

/// Arrays smaller than this are left to the allocator: they hold no whole 2 MiB page
/// worth asking for.
const THRESHOLD: usize = 4 << 20;

/// A huge page's size on x86-64 and arm64 with 4 KiB base pages.
const HUGE_PAGE: usize = 2 << 20;

/// `n` items made by `f`, in a vector whose memory is advised for huge pages before
/// the items are written (pages are then faulted in 2 MiB at a time).
pub fn huge_vec<T>(n: usize, mut f: impl FnMut(usize) -> T) -> Vec<T> {
    let mut v: Vec<T> = Vec::with_capacity(n);
    let bytes = n.saturating_mul(std::mem::size_of::<T>());
    if bytes >= THRESHOLD {
        let start = v.as_mut_ptr() as usize;
        // Inward to whole huge pages: the advice covers only memory the vector owns.
        let first = start.div_ceil(HUGE_PAGE) * HUGE_PAGE;
        let end = (start + bytes) / HUGE_PAGE * HUGE_PAGE;
        if end > first {
            advise_huge(first, end - first);
        }
    }
    v.extend((0..n).map(&mut f));
    v
}

/// `madvise(MADV_HUGEPAGE)` on `[addr, addr + len)`; failure is ignored (it is advice).
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn advise_huge(addr: usize, len: usize) {
    // SAFETY: the range is page-aligned and lies inside one live allocation owned by the
    // caller (`huge_vec` aligns it inward). MADV_HUGEPAGE only sets how the kernel may back
    // those pages; it neither reads nor writes them, nor changes what is mapped, so no
    // Rust value can observe it. An error (EINVAL where THP is not built in) changes
    // nothing and is ignored.
    unsafe {
        libc::madvise(addr as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
    }
}

#[cfg(not(target_os = "linux"))]
fn advise_huge(_addr: usize, _len: usize) {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_and_large_vectors_hold_what_was_made() {
        let small = huge_vec(3, |i| i * 2);
        assert_eq!(small, vec![0, 2, 4]);
        // Past the threshold: advised, then written; every item is there and in order.
        let n = (THRESHOLD / std::mem::size_of::<u64>()) * 3 + 7;
        let large = huge_vec(n, |i| i as u64);
        assert_eq!(large.len(), n);
        assert_eq!(large.capacity(), n);
        assert!(large.iter().enumerate().all(|(i, &x)| x == i as u64));
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_large_vector_is_advised_for_huge_pages() {
        // The kernel lists advised mappings with `hg` in their VmFlags; where THP is not
        // built in at all, there is nothing to check.
        let enabled = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled");
        if enabled.is_err() {
            return;
        }
        let n = 4 * THRESHOLD;
        let v = huge_vec(n, |i| i as u8);
        let at = v.as_ptr() as usize + n / 2;
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap_or_default();
        assert!(
            advised(&smaps, at),
            "the mapping holding {at:#x} is not advised"
        );
    }

    /// Whether the mapping holding `addr` in `smaps` has the `hg` (MADV_HUGEPAGE) flag.
    #[cfg(target_os = "linux")]
    fn advised(smaps: &str, addr: usize) -> bool {
        let mut inside = false;
        for line in smaps.lines() {
            let range = line
                .split_whitespace()
                .next()
                .and_then(|r| r.split_once('-'))
                .and_then(|(a, b)| {
                    Some((
                        usize::from_str_radix(a, 16).ok()?,
                        usize::from_str_radix(b, 16).ok()?,
                    ))
                });
            if let Some((a, b)) = range {
                inside = (a..b).contains(&addr);
            }
            if inside && line.starts_with("VmFlags:") {
                return line.split_whitespace().any(|f| f == "hg");
            }
        }
        false
    }
}
