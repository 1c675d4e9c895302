//! tollgate's runtime. The layers, from the ground up, and the request path through them
//! are in ARCHITECTURE.md: `exchange` (what the layers exchange) → the listener and the
//! limiter → upstreams and the cluster link → the snapshot → policies and the cache →
//! routing → [`Gateway`], whose pipeline serves a request phase by phase.
//!
//! The public surface is what the `tollgate` binary and the tests use; every other module
//! is the crate's own.
#![forbid(unsafe_code)]

pub mod admin;
pub(crate) mod cache;
pub(crate) mod clock;
pub(crate) mod cluster;
pub mod echo;
pub(crate) mod exchange;
pub(crate) mod file_lock;
pub(crate) mod file_stat;
#[doc(hidden)]
pub mod fuzz;
pub(crate) mod gateway;
pub(crate) mod https_link;
pub(crate) mod inbound;
pub(crate) mod jwks;
pub(crate) mod limiter;
pub(crate) mod listener;
pub(crate) mod observe;
pub(crate) mod policy;
pub(crate) mod query;
pub(crate) mod redis_link;
pub(crate) mod response;
pub(crate) mod roster;
pub(crate) mod route;
pub(crate) mod snapshot;
pub(crate) mod sqlite;
pub(crate) mod upstream;
pub mod usage;
pub mod watch;

pub use clock::{Clock, ManualClock, SystemClock};
pub use cluster::{Cluster, ClusterMetrics, LEASE};
pub use exchange::ConnInfo;
pub use gateway::{preflight, Findings, Gateway, ReloadStatus};
/// Makes ring verify token signatures in this process (the gateway does so when it first
/// meets a token route; a process that uses jsonwebtoken before that calls this first).
pub use jwks::install_crypto;
pub use limiter::Now;
pub use listener::{bind, BindError, Server};
pub use observe::analytics;
pub use snapshot::{Registry, Snapshot};
