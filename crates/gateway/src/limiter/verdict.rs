//! What a check says: where a limit stands, or why it refused.

use std::time::Duration;

/// Where a limit stands after a check, for the RateLimit headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Standing {
    /// Index of the limit among those checked.
    pub index: usize,
    /// Requests left now.
    pub remaining: u64,
    /// Time until more requests are allowed (for a refusal, until this one would pass).
    pub reset: Duration,
}

/// Why a check refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// A limit is used up.
    Limit(Standing),
    /// A shared limit has no token in hand and no credit, and its lease is on its way:
    /// checked again once the cluster's next round lands, the request may pass. Nothing
    /// was counted. `reset`: when to retry if it does not.
    Leasing(Standing),
    /// A shared limit cannot be checked (Redis unreachable, `on_redis_down: closed`).
    StoreDown,
    /// A cell was retired while the request held it: nothing was counted; look the
    /// consumer's counters up again.
    Retired,
}
