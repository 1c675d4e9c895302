//! Limits shared by several nodes through Redis, with no Redis call on the request path.
//!
//! A shared limit of N per window W is counted in fixed windows aligned to the wall clock
//! (`[kW, (k+1)W)`, the same on every node). Redis holds, per limit and window, how many
//! requests have been granted cluster-wide. A node admits a request from **tokens** it has
//! leased from Redis beforehand; a background task (one per node) leases more every
//! `sync_interval`, in one pipelined round of Lua calls that each grant
//! `min(want, N − granted)` atomically. Lease sizes follow each node's own traffic
//! (its recent rate × (two sync intervals + three Redis round trips)), capped at a fair
//! share of what is left (`(N − granted) / nodes`), so the budget goes where the traffic is.
//! Near a window's end, busy nodes lease for the next window so it starts with tokens.
//!
//! A node without tokens may admit a few requests on **credit** — at most
//! `floor(N × max_overadmission / nodes)` outstanding — and pays them from its next lease.
//! Credit is the only way to admit without a grant, so with Redis reachable:
//!
//! > cluster-wide admitted per window ≤ N + nodes × floor(N × max_overadmission / nodes)
//! > ≤ N × (1 + max_overadmission)
//!
//! whatever the sync interval, the rates or the split of traffic (and exactly N when
//! `N × max_overadmission < nodes`, e.g. a limit of 1: it waits for its token). Tokens a node
//! leased and did not use by the window's end are lost: that is under-admission, never over.
//!
//! While Redis is unreachable, `on_redis_down: open` lets each node admit up to its last
//! share (what it admitted in the previous window, or N / nodes without history), so the
//! cluster admits at most Σ last shares ≈ N per window when traffic keeps its split (at most
//! nodes × N in the worst case); `closed` answers 503. Requests admitted meanwhile are
//! settled with Redis if it is back before their window ends. Reconnects back off from
//! 100 ms to 5 s.

mod link;
mod report;
mod sync;

pub use link::{Cluster, ClusterMetrics};
pub use sync::spawn_syncer;
