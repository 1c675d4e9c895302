//! Upstreams: a keep-alive pool per upstream, round-robin over its targets, header
//! rewriting for the hop, timeouts, and retries only when they are safe.
//!
//! Retries: a request that was never written (connect failure, a pooled connection found
//! closed before the write) moves on to the next connection or target, whatever its method.
//! When a backend's close of a kept-alive connection races the write, an idempotent request
//! without a body (GET, HEAD, OPTIONS, PUT, DELETE, TRACE) is sent again on another
//! connection. A new connection that fails is not retried on the same target. A
//! non-idempotent request is never sent twice.

mod ahead;
mod alt;
mod body;
pub(crate) mod cap;
mod checks;
mod dial;
mod forward;
pub(crate) mod h1;
mod headers;
pub mod health;
mod idle;
mod pool;
pub mod report;
mod target;
mod upgrade;
mod via_alt;
mod with_body;

pub use forward::{fetch, forward};
pub use headers::{forwarding_header, sent, Sent};
pub use pool::{Collector, PooledBody};
pub use target::{AnsweredBy, Hop, Upstream};
pub use upgrade::{upgrade, UpgradeAsk};
