//! tollgate's runtime, in the order a request meets it:
//! [`listener`] → [`inbound`] → [`route`] → [`policy`] (method, CORS, auth, authz, limits) →
//! [`upstream`] → [`response`]. [`snapshot`] compiles a validated config into what the
//! request path reads; [`gateway`] pins a snapshot per request and swaps it on reload.
#![forbid(unsafe_code)]

pub mod admin;
pub mod cache;
pub mod clock;
pub mod cluster;
pub mod echo;
pub mod exchange;
#[doc(hidden)]
pub mod fuzz;
pub mod gateway;
pub mod inbound;
pub mod limiter;
pub mod listener;
pub mod observe;
pub mod policy;
pub mod query;
pub mod redis_link;
pub mod response;
pub mod route;
pub mod snapshot;
mod sqlite;
pub mod upstream;
pub mod usage;
pub mod watch;

pub use clock::{Clock, ManualClock, SystemClock};
pub use exchange::ConnInfo;
pub use gateway::{Gateway, ReloadStatus};
pub use listener::{bind, BindError, Server};
