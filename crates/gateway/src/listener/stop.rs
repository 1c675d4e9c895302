//! How a connection learns that the server stops: a flag read at each step, and a
//! notification for connections that wait.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

/// The server's stop signal as a connection sees it.
#[derive(Clone)]
pub struct Stop {
    /// Set before `notify` is told, and read at each poll: an atomic load.
    pub flag: Arc<AtomicBool>,
    /// Wakes every connection when the server stops.
    pub notify: Arc<tokio::sync::Notify>,
}
