//! Upstreams: a keep-alive pool per upstream, round-robin over its targets, header
//! rewriting for the hop, timeouts, and retries only when they are safe.
//!
//! Every HTTP/1.1 request goes on the lean client over one pool per target, through one
//! retry driver (`forward.rs`, which says when a request is sent again).

mod ahead;
mod alt;
mod body;
pub(crate) mod cap;
mod checks;
mod dial;
mod forward;
mod gather;
pub(crate) mod h1;
mod h1_request;
pub(crate) mod h1_response;
mod h1_upload;
mod headers;
pub mod health;
mod hop;
mod hosts;
mod idle;
pub mod report;
mod response_body;
mod target;
mod upgrade;
mod via_alt;

pub use forward::{fetch, forward};
pub use headers::{forwarding_name, sent, Sent};
pub use hop::{Hop, Strip};
pub use response_body::{Collector, PooledBody};
pub use target::{AnsweredBy, Upstream};
pub use upgrade::{upgrade, UpgradeAsk};
