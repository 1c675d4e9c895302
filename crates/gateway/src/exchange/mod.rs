//! The ground floor: what the request path's layers exchange — the client connection's
//! facts and the reasons the gateway answers itself. It imports nothing of the runtime.

pub mod conn;
pub mod head;
pub mod refusal;

pub use conn::{ConnInfo, Place, UpstreamShare, UpstreamWork};
pub use head::{Fields, Lines, Parts};
pub use refusal::{Refusal, REASONS};
