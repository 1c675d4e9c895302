//! The flood guard of one HTTP/2 connection: what a client may make the server do for
//! nothing before it is told to go away (GOAWAY `ENHANCE_YOUR_CALM`).
//!
//! - **Resets** (CVE-2023-44487, CVE-2025-8671): a balance. An answer that took upstream
//!   work banks one (up to the stream limit); a client's reset of a stream it has not
//!   let be answered, and a server reset of a stream already handed to the gateway, spend
//!   one. Below `-max_resets` the client is too far in debt. The balance moves one step
//!   towards zero per second: credit does not keep, an old debt is forgiven.
//! - **Local resets**: streams reset before they reached the gateway (malformed,
//!   refused): a well-made client sends none; past [`MAX_LOCAL_RESETS`] it goes.
//! - **Frames that carry nothing** in a row (empty DATA or CONTINUATION that end nothing,
//!   unknown types), as Envoy and Sozu count them: past [`MAX_USELESS_FRAMES`].
//! - **CONTINUATION** (CVE-2024-27316): a header block in more than [`MAX_CONTINUATIONS`]
//!   pieces, or larger than any header list allowed could decode from.
//!
//! It does no I/O and reads no clock of its own: the connection passes the time.

use super::super::frame::{flag, kind};
use tokio::time::Instant;

/// Streams reset before they reached the gateway before the client is told to go away.
pub(super) const MAX_LOCAL_RESETS: usize = 64;
/// Frames in a row that carry nothing before the client is told to go away.
pub(super) const MAX_USELESS_FRAMES: u32 = 100;
/// CONTINUATION frames one header block may take.
pub(super) const MAX_CONTINUATIONS: u32 = 32;

/// One connection's flood counts.
#[derive(Debug)]
pub(super) struct FloodGuard {
    /// Answered streams bank one each (up to `max_banked`), resets spend one.
    reset_balance: i64,
    /// When the balance last moved one step towards zero.
    balance_at: Instant,
    /// The debt past which the client is told to calm down (`max_pending_resets`).
    max_debt: i64,
    /// The most a balance banks (the stream limit).
    max_banked: i64,
    local_resets: usize,
    useless: u32,
}

impl FloodGuard {
    /// A guard allowing `max_resets` resets in debt, banking at most `max_streams`.
    pub(super) fn new(max_resets: usize, max_streams: u32, now: Instant) -> Self {
        FloodGuard {
            reset_balance: 0,
            balance_at: now,
            max_debt: i64::try_from(max_resets).unwrap_or(i64::MAX),
            max_banked: i64::from(max_streams),
            local_resets: 0,
            useless: 0,
        }
    }

    /// Moves the balance one step towards zero per whole second since it last moved.
    fn decay(&mut self, now: Instant) {
        let secs = now.saturating_duration_since(self.balance_at).as_secs();
        if secs == 0 {
            return;
        }
        self.balance_at = now;
        let step = i64::try_from(secs).unwrap_or(i64::MAX);
        self.reset_balance = if self.reset_balance > 0 {
            (self.reset_balance - step).max(0)
        } else {
            (self.reset_balance + step).min(0)
        };
    }

    /// Spends one reset (the client's of a stream in flight, or the server's of a stream
    /// handed to the gateway); whether the client is now too far in debt.
    pub(super) fn spend_reset(&mut self, now: Instant) -> bool {
        self.decay(now);
        self.reset_balance -= 1;
        self.in_debt()
    }

    /// An answer that took upstream work was sent: it banks one reset.
    pub(super) fn bank(&mut self, now: Instant) {
        self.decay(now);
        self.reset_balance = (self.reset_balance + 1).min(self.max_banked);
    }

    /// A stream was reset before it reached the gateway.
    pub(super) fn local_reset(&mut self) {
        self.local_resets += 1;
    }

    fn in_debt(&self) -> bool {
        self.reset_balance < -self.max_debt
    }

    /// Whether the resets so far are a flood.
    pub(super) fn exceeded(&self) -> bool {
        self.local_resets > MAX_LOCAL_RESETS || self.in_debt()
    }

    /// Counts a frame of kind `k` whose payload without padding is `len`: only a frame
    /// that carries a request or data starts the count of useless frames again; control
    /// frames leave it as it is. Whether the frames in a row that carried nothing are now a
    /// flood.
    pub(super) fn frame(&mut self, k: u8, flags: u8, len: usize) -> bool {
        let useless = match k {
            kind::DATA if len > 0 => {
                self.useless = 0;
                return false;
            }
            kind::DATA => flags & flag::END_STREAM == 0,
            kind::HEADERS => {
                self.useless = 0;
                return false;
            }
            kind::CONTINUATION => len == 0 && flags & flag::END_HEADERS == 0,
            kind::PRIORITY
            | kind::RST_STREAM
            | kind::SETTINGS
            | kind::PUSH_PROMISE
            | kind::PING
            | kind::GOAWAY
            | kind::WINDOW_UPDATE => false,
            _ => true,
        };
        if useless {
            self.useless += 1;
        }
        self.useless > MAX_USELESS_FRAMES
    }
}

/// Whether a header block of `len` bytes in `frames` CONTINUATION frames is a flood: more
/// pieces than any client needs, or more bytes than a header list of `max_list` could be
/// decoded from (plus one frame).
pub(super) fn block_flood(len: usize, frames: u32, max_list: usize, max_frame: usize) -> bool {
    len > 4 * max_list + max_frame || frames > MAX_CONTINUATIONS
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn resets_in_debt_past_the_limit_are_a_flood() {
        let t = Instant::now();
        let mut g = FloodGuard::new(3, 100, t);
        for _ in 0..3 {
            assert!(!g.spend_reset(t));
        }
        assert!(g.spend_reset(t), "the fourth reset in debt");
        assert!(g.exceeded());
    }

    #[test]
    fn answers_bank_resets_up_to_the_stream_limit() {
        let t = Instant::now();
        let mut g = FloodGuard::new(0, 2, t);
        for _ in 0..10 {
            g.bank(t);
        }
        assert!(!g.spend_reset(t));
        assert!(!g.spend_reset(t));
        assert!(g.spend_reset(t), "only two were banked");
    }

    #[test]
    fn the_balance_moves_towards_zero_by_the_second() {
        let t = Instant::now();
        let mut g = FloodGuard::new(1, 100, t);
        assert!(!g.spend_reset(t));
        // A second later the debt of one is forgiven: two more fit before the flood.
        let later = t + Duration::from_secs(1);
        assert!(!g.spend_reset(later));
        assert!(g.spend_reset(later));
        // Banked credit does not keep either.
        let mut g = FloodGuard::new(0, 100, t);
        for _ in 0..5 {
            g.bank(t);
        }
        assert!(g.spend_reset(t + Duration::from_secs(10)));
    }

    #[test]
    fn local_resets_past_the_limit_are_a_flood() {
        let mut g = FloodGuard::new(100, 100, Instant::now());
        for _ in 0..MAX_LOCAL_RESETS {
            g.local_reset();
        }
        assert!(!g.exceeded());
        g.local_reset();
        assert!(g.exceeded());
    }

    #[test]
    fn only_frames_that_carry_something_restart_the_useless_count() {
        let mut g = FloodGuard::new(100, 100, Instant::now());
        for _ in 0..MAX_USELESS_FRAMES {
            assert!(!g.frame(kind::DATA, 0, 0));
            // Control frames neither count nor restart the count.
            assert!(!g.frame(kind::PING, 0, 8));
        }
        assert!(g.frame(0xfa, 0, 3), "one more frame of unknown type");
        let mut g = FloodGuard::new(100, 100, Instant::now());
        for _ in 0..MAX_USELESS_FRAMES {
            assert!(!g.frame(kind::CONTINUATION, 0, 0));
        }
        assert!(!g.frame(kind::DATA, 0, 1), "data restarts the count");
        assert!(
            !g.frame(kind::DATA, flag::END_STREAM, 0),
            "an empty end is no useless frame"
        );
        for _ in 0..MAX_USELESS_FRAMES {
            assert!(!g.frame(kind::DATA, 0, 0));
        }
        assert!(!g.frame(kind::HEADERS, flag::END_HEADERS, 0));
        assert!(!g.frame(kind::DATA, 0, 0));
    }

    #[test]
    fn header_blocks_in_too_many_pieces_or_too_large_are_a_flood() {
        assert!(!block_flood(1000, MAX_CONTINUATIONS, 16_384, 16_384));
        assert!(block_flood(1000, MAX_CONTINUATIONS + 1, 16_384, 16_384));
        assert!(!block_flood(4 * 16_384 + 16_384, 1, 16_384, 16_384));
        assert!(block_flood(4 * 16_384 + 16_385, 1, 16_384, 16_384));
    }
}
