//! Counts kept in the consumer's table slot instead of a cell, while each of its limits
//! has all its counts in one sub-window.
//!
//! With a million consumers most calls are a consumer's only call in its windows: making a
//! cell for it (a key, a hash table entry, 184 bytes) and retiring it later cost more than
//! the rest of the check. A limit whose counts all sit in one sub-window is two numbers
//! (the sub-window and the count), the window [`super::Window::single`] spells out, and
//! [`check`] gives the answer [`super::check`] gives on that window. Only a call in a later
//! sub-window while earlier counts still count needs the full window: then the consumer's
//! cells are made with these counts ([`super::table`]).

use super::{slot_ns_of, Refused, Standing, Tally, Window, SLOTS};
use smallvec::SmallVec;
use std::sync::Arc;
use std::time::Duration;
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

    /// The count as it stands in sub-window `now_slot`: 0 once the window has passed.
    fn counting(self, now_slot: u64) -> u64 {
        let ends = u64::from(self.slot).saturating_add(SLOTS as u64);
        if now_slot >= ends {
            0
        } else {
            u64::from(self.count)
        }
    }
}

/// The full windows of the first `n` limits' counts (in layout order).
pub(crate) fn windows(lights: &Lights, n: usize) -> Vec<Window> {
    lights.iter().take(n).map(|l| l.window()).collect()
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
    lights
        .iter()
        .zip(limits)
        .any(|(l, (limit, _))| l.counting(now / slot_ns_of(limit.window)) > 0)
}

/// What a light check did.
pub enum Checked {
    /// Answered, and the counts are still light.
    Kept(Result<Option<Standing>, Refused>),
    /// Answered and counted, but some limit now has counts in two sub-windows: the
    /// consumer needs cells holding these windows (in layout order).
    Grown(Result<Option<Standing>, Refused>, Vec<Window>),
}

/// One checked limit: where its counts stand at the time of the check.
struct Seen {
    /// Its place in the layout and in `positions`.
    at: usize,
    ix: usize,
    requests: u64,
    slot_ns: u64,
    /// The sub-window of `now`.
    now_slot: u64,
    /// Its sub-window and count, the count 0 once the window has passed.
    slot: u64,
    count: u64,
}

impl Seen {
    /// When the counts of the oldest sub-window counted stop counting (ns).
    fn ends(&self) -> u64 {
        let oldest = if self.count == 0 {
            self.now_slot
        } else {
            self.slot
        };
        oldest
            .saturating_add(SLOTS as u64)
            .saturating_mul(self.slot_ns)
    }

    /// The full window after counting one more request.
    fn counted(&self) -> Window {
        let mut w = Window::single(self.slot, self.count);
        w.advance(self.now_slot);
        w.count_one(self.requests);
        w
    }
}

/// Checks the limits at `positions` of the layout `limits` against `lights` and counts
/// the request in each if all have room: the same rules and answer as [`super::check`]
/// on the windows these counts stand for, in a few operations on two numbers a limit. A
/// standing's `index` is its place in `positions`.
pub fn check(
    lights: &mut Lights,
    limits: &[(LimitConfig, Option<Arc<str>>)],
    positions: &[usize],
    now: u64,
) -> Checked {
    let mut seen: SmallVec<[Seen; MAX]> = SmallVec::new();
    let mut tally = Tally::default();
    for (ix, &at) in positions.iter().enumerate() {
        let (Some((limit, _)), Some(light)) = (limits.get(at), lights.get(at)) else {
            continue;
        };
        let slot_ns = slot_ns_of(limit.window);
        let now_slot = now / slot_ns;
        let s = Seen {
            at,
            ix,
            requests: limit.requests,
            slot_ns,
            now_slot,
            slot: u64::from(light.slot),
            count: light.counting(now_slot),
        };
        if s.count >= s.requests {
            let wait = if s.count == 0 {
                slot_ns.saturating_mul(SLOTS as u64)
            } else {
                s.ends().saturating_sub(now)
            };
            tally.full(ix, wait);
        }
        seen.push(s);
    }
    if let Some(r) = tally.refused {
        return Checked::Kept(Err(r));
    }
    let mut next = *lights;
    let mut grown = false;
    for s in &seen {
        let (slot, count) = if s.count == 0 {
            (s.now_slot, 1)
        } else {
            (s.slot, s.count + 1)
        };
        let same = s.count == 0 || s.now_slot <= s.slot;
        match (same, u32::try_from(slot), u32::try_from(count)) {
            (true, Ok(slot), Ok(count)) => next[s.at] = Light { slot, count },
            _ => grown = true,
        }
        tally.admitted(Standing {
            index: s.ix,
            remaining: s.requests.saturating_sub(s.count + 1),
            reset: Duration::from_nanos(s.ends().saturating_sub(now)),
        });
    }
    let checked = Ok(tally.tightest);
    if !grown {
        *lights = next;
        return Checked::Kept(checked);
    }
    let mut windows = windows(lights, limits.len());
    for s in &seen {
        if let Some(w) = windows.get_mut(s.at) {
            *w = s.counted();
        }
    }
    Checked::Grown(checked, windows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const S: u64 = 1_000_000_000;

    fn limit(requests: u64, secs: u64) -> (LimitConfig, Option<Arc<str>>) {
        let l = LimitConfig {
            name: "l".into(),
            counted_as: "l".into(),
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
        assert_eq!(windows[0].slots.iter().filter(|&&n| n > 0).count(), 2);
    }

    /// Counts in `l` for `limit` at `now`, as a cell's `used` reports them.
    fn used(l: Light, limit: &LimitConfig, now: u64) -> u64 {
        let mut w = l.window();
        w.advance(now / slot_ns_of(limit.window));
        w.total
    }

    #[test]
    fn light_counts_answer_as_cells_do() {
        use super::super::{LimitCell, Now};
        let limits = [limit(3, 1), limit(5, 2)];
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let mut rnd = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let (mut refused, mut grown) = (0, 0);
        for _ in 0..300 {
            let cells: Vec<Arc<LimitCell>> = (0..2)
                .map(|k| {
                    let (l, _) = &limits[k];
                    Arc::new(LimitCell::new(k as u64, l.requests, l.window, "t".into()))
                })
                .collect();
            let mut lights = Lights::default();
            let mut now = rnd() % (5 * S);
            for _ in 0..40 {
                now += match rnd() % 4 {
                    0 => 0,
                    1 => rnd() % (S / 20),
                    _ => rnd() % (S / 2),
                };
                let positions: &[usize] = match rnd() % 3 {
                    0 => &[0],
                    1 => &[1],
                    _ => &[0, 1],
                };
                let refs: Vec<&Arc<LimitCell>> = positions.iter().map(|&p| &cells[p]).collect();
                let want = super::super::check(
                    &refs,
                    Now {
                        mono: now,
                        wall: now,
                    },
                );
                match check(&mut lights, &limits, positions, now) {
                    Checked::Kept(got) => {
                        assert_eq!(got, want, "at {now}");
                        refused += usize::from(got.is_err());
                        for (k, (l, _)) in limits.iter().enumerate() {
                            assert_eq!(
                                used(lights[k], l, now),
                                cells[k].used(Now {
                                    mono: now,
                                    wall: now
                                })
                            );
                        }
                    }
                    Checked::Grown(got, windows) => {
                        assert_eq!(got, want, "at {now}");
                        for (k, (l, _)) in limits.iter().enumerate() {
                            let mut w = windows[k].clone();
                            w.advance(now / slot_ns_of(l.window));
                            assert_eq!(
                                w.total,
                                cells[k].used(Now {
                                    mono: now,
                                    wall: now
                                })
                            );
                        }
                        grown += 1;
                        break;
                    }
                }
            }
        }
        assert!(
            refused > 100 && grown > 100,
            "refused {refused}, grown {grown}"
        );
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
