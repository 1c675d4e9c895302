//! Counts kept in the consumer's table slot instead of a cell, while each of its limits
//! has all its counts in one sub-window.
//!
//! With a million consumers most calls are a consumer's only call in its windows: making a
//! cell for it (a key, a hash table entry, 184 bytes) and retiring it later cost more than
//! the rest of the check. A limit whose counts all sit in one sub-window is two numbers
//! (the sub-window and the count), the same window [`super::Window::single`] spells out,
//! so it is checked by the same rules ([`super::check_plain`]) and stays in the slot.
//! Only a call in a later sub-window while earlier counts still count needs the full
//! window: then the consumer's cells are made with these counts ([`super::table`]).

use super::{check_plain, slot_ns_of, Plain, Refused, Standing, Window};
use smallvec::SmallVec;
use std::sync::Arc;
use tollgate_config::LimitConfig;

/// Limits a slot holds without cells; a plan with more takes cells on first call.
pub const MAX: usize = 2;

/// One limit's counts, all in one sub-window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Light {
    /// The sub-window (monotonic time / sub-window length).
    slot: u32,
    /// Requests counted in it.
    count: u32,
}

/// A consumer's light counts, in its plan's layout order.
pub type Lights = [Light; MAX];

impl Light {
    /// The full window these counts stand for.
    pub(crate) fn window(self) -> Window {
        Window::single(u64::from(self.slot), u64::from(self.count))
    }

    /// `w` as light counts, when all of its counts are in one sub-window and fit.
    fn of(w: &Window) -> Option<Light> {
        let (slot, count) = w.as_single()?;
        Some(Light {
            slot: u32::try_from(slot).ok()?,
            count: u32::try_from(count).ok()?,
        })
    }
}

/// Whether a plan's limits can be counted light: few enough, and every count fits.
pub fn fits(limits: &[(LimitConfig, Option<Arc<str>>)]) -> bool {
    limits.len() <= MAX
        && limits
            .iter()
            .all(|(l, _)| u32::try_from(l.requests).is_ok())
}

/// Whether any of the counts still count at `now` (monotonic nanoseconds).
pub fn in_use(lights: &Lights, limits: &[(LimitConfig, Option<Arc<str>>)], now: u64) -> bool {
    lights.iter().zip(limits).any(|(l, (limit, _))| {
        let mut w = l.window();
        w.full(u64::MAX, slot_ns_of(limit.window), now);
        w.total > 0
    })
}

/// What a light check did.
pub enum Checked {
    /// Answered, and the counts are still light.
    Kept(Result<Option<Standing>, Refused>),
    /// Answered and counted, but some limit now has counts in two sub-windows: the
    /// consumer needs cells holding these windows (in layout order).
    Grown(Result<Option<Standing>, Refused>, Vec<Window>),
}

/// Checks the limits at `positions` of the layout `limits` against `lights` and counts
/// the request in each if all have room, like [`super::check`]. A standing's `index` is
/// its place in `positions`.
pub fn check(
    lights: &mut Lights,
    limits: &[(LimitConfig, Option<Arc<str>>)],
    positions: &[usize],
    now: u64,
) -> Checked {
    // The positions in the layout (all of them, as snapshots build them), with their
    // place in `positions`.
    let mut at: SmallVec<[(usize, usize); MAX]> = SmallVec::new();
    let mut plain: SmallVec<[Plain; MAX]> = SmallVec::new();
    for (ix, &p) in positions.iter().enumerate() {
        if let (Some((limit, _)), Some(light)) = (limits.get(p), lights.get(p)) {
            at.push((p, ix));
            plain.push(Plain {
                window: light.window(),
                requests: limit.requests,
                slot_ns: slot_ns_of(limit.window),
            });
        }
    }
    let checked = check_plain(&mut plain, now).map(|s| s.map(|s| place(s, &at)));
    let checked = checked.map_err(|e| match e {
        Refused::Limit(s) => Refused::Limit(place(s, &at)),
        other => other,
    });
    let mut next = *lights;
    for (&(p, _), l) in at.iter().zip(&plain) {
        match Light::of(&l.window) {
            Some(light) => next[p] = light,
            None => {
                let mut windows: Vec<Window> = lights
                    .iter()
                    .take(limits.len())
                    .map(|l| l.window())
                    .collect();
                for (&(p, _), l) in at.iter().zip(plain) {
                    windows[p] = l.window;
                }
                return Checked::Grown(checked, windows);
            }
        }
    }
    *lights = next;
    Checked::Kept(checked)
}

/// `s` with its index turned from a place among the checked limits into one in
/// `positions`.
fn place(s: Standing, at: &[(usize, usize)]) -> Standing {
    Standing {
        index: at.get(s.index).map_or(0, |a| a.1),
        ..s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const S: u64 = 1_000_000_000;

    fn limit(requests: u64, secs: u64) -> (LimitConfig, Option<Arc<str>>) {
        let l = LimitConfig {
            name: "l".into(),
            requests,
            window: Duration::from_secs(secs),
        };
        (l, None)
    }

    #[test]
    fn calls_in_one_sub_window_stay_light_and_are_refused_past_the_limit() {
        let limits = [limit(2, 10)];
        let mut lights = Lights::default();
        for want in [Some(1), Some(0)] {
            let Checked::Kept(Ok(s)) = check(&mut lights, &limits, &[0], 5 * S) else {
                panic!("light and admitted")
            };
            assert_eq!(s.map(|s| s.remaining), want);
        }
        let Checked::Kept(Err(Refused::Limit(r))) = check(&mut lights, &limits, &[0], 5 * S) else {
            panic!("refused, still light")
        };
        // Both counts are in the sub-window [5 s, 6 s), which stops counting at 16 s.
        assert_eq!(r.reset, Duration::from_secs(11));
        // Once the window has passed, the next call starts again from nothing.
        assert!(matches!(
            check(&mut lights, &limits, &[0], 17 * S),
            Checked::Kept(Ok(Some(Standing { remaining: 1, .. })))
        ));
    }

    #[test]
    fn a_second_sub_window_within_the_window_grows_the_counts() {
        let limits = [limit(5, 10), limit(100, 3600)];
        let mut lights = Lights::default();
        assert!(matches!(
            check(&mut lights, &limits, &[0, 1], 0),
            Checked::Kept(Ok(_))
        ));
        // Only the route's own second limit is checked here, in the same sub-window.
        assert!(matches!(
            check(&mut lights, &limits, &[1], S / 2),
            Checked::Kept(Ok(_))
        ));
        let Checked::Grown(Ok(Some(s)), windows) = check(&mut lights, &limits, &[0, 1], 2 * S)
        else {
            panic!("grown")
        };
        assert_eq!((s.index, s.remaining), (0, 3));
        assert_eq!(windows.len(), 2);
        assert_eq!((windows[0].total, windows[1].total), (2, 3));
        assert_eq!(windows[0].as_single(), None);
    }

    #[test]
    fn plans_with_many_limits_or_huge_counts_take_cells() {
        assert!(fits(&[limit(1, 1), limit(u64::from(u32::MAX), 60)]));
        assert!(!fits(&[limit(1, 1), limit(2, 2), limit(3, 3)]));
        assert!(!fits(&[limit(u64::from(u32::MAX) + 1, 1)]));
    }

    #[test]
    fn in_use_until_every_window_has_passed() {
        let limits = [limit(5, 10)];
        let mut lights = Lights::default();
        assert!(!in_use(&lights, &limits, 0));
        let _ = check(&mut lights, &limits, &[0], 3 * S);
        assert!(in_use(&lights, &limits, 13 * S));
        assert!(!in_use(&lights, &limits, 14 * S));
    }
}
