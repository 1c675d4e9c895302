//! The gateway: its state ([`Gateway`]), how it starts, how it reloads, and the request
//! path it serves, phase by phase ([`pipeline`]).

mod ctx;
mod fetch;
mod logged_head;
mod logging;
mod pipeline;
mod preflight;
mod reload;
mod start;
mod state;
mod unread;
mod writes;

pub use preflight::{preflight, Findings};
pub use state::{Gateway, ReloadStatus};
pub use tollgate_config::fingerprint;
