//! Limits shared by several nodes through Redis, with no Redis call on the request path.
//!
//! A shared limit of N per window W is counted as one node counts it, in sub-windows of W/10,
//! here aligned to the wall clock (the same on every node). Redis holds, per limit, a hash of
//! sub-window → requests counted cluster-wide. A node admits a request from **tokens** it has
//! leased from Redis for the current sub-window; a background task (one per node) leases
//! more every `sync_interval`, in one pipelined round of Lua calls (one per hash slot on a
//! Redis Cluster) that each grant `min(want, N − counted)`, `counted` summing the sub-window's
//! window and any later sub-window, so no 11 consecutive sub-windows hold more than N grants.
//! Lease sizes follow each node's own traffic, capped at a fair share of what is left. Near
//! a sub-window's end, busy nodes lease for the next one; tokens left when a sub-window ends
//! go back to Redis.
//!
//! A node without tokens may admit a few requests on **credit** — at most
//! `floor(N × max_overadmission / nodes)` outstanding — which its next round adds to their
//! sub-window. Credit is the only way to admit without a grant, so with Redis reachable:
//!
//! > cluster-wide admitted in any interval of length W ≤ N + nodes × floor(N × max_overadmission / nodes)
//! > ≤ N × (1 + max_overadmission)
//!
//! While Redis is unreachable (on a Redis Cluster: the master that keeps the limit, each
//! master's part of a round being settled on its own), `on_redis_down: open` lets each node admit up to its share
//! (its own last window plus an even split of the room left); `closed` answers 503. When
//! Redis is back, what a node admitted alone is added to the sub-windows it was admitted in,
//! so the others see it. Reconnects back off from 100 ms to 5 s (1 s with Sentinel or a
//! Redis Cluster, to follow a failover quickly).

mod asks;
mod link;
mod report;
mod sync;

pub use asks::LEASE;
pub use link::{Cluster, ClusterMetrics};
pub use sync::spawn_syncer;
