//! The cap on connections open at once to one target (`max_connections`). Each open connection holds a permit until it closes; a request that
//! needs a new connection at the cap waits (bounded) for a permit or an idle connection.

use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

/// The connections of one target.
#[derive(Debug)]
pub struct Cap {
    permits: Arc<Semaphore>,
    max: usize,
    /// Signalled when a connection goes back to an idle list.
    pub(crate) returned: Notify,
}

/// What a request waiting at the cap got.
pub enum Slot<T> {
    /// An idle connection.
    Idle(T),
    /// Room for a new connection.
    New(OwnedSemaphorePermit),
}

impl Cap {
    /// A cap of `max` connections.
    pub fn new(max: usize) -> Arc<Cap> {
        Arc::new(Cap {
            permits: Arc::new(Semaphore::new(max)),
            max,
            returned: Notify::new(),
        })
    }

    /// Connections open now (each holds a permit).
    pub fn open(&self) -> usize {
        self.max.saturating_sub(self.permits.available_permits())
    }

    /// An idle connection from `checkout`, or room for a new one, waiting at most `wait`.
    /// `None` when the wait ran out.
    pub async fn slot<T>(
        &self,
        checkout: impl Fn() -> Option<T>,
        wait: Duration,
    ) -> Option<Slot<T>> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let returned = self.returned.notified();
            if let Some(c) = checkout() {
                return Some(Slot::Idle(c));
            }
            if let Ok(p) = self.permits.clone().try_acquire_owned() {
                return Some(Slot::New(p));
            }
            tokio::select! {
                p = self.permits.clone().acquire_owned() => {
                    if let Ok(p) = p {
                        return Some(Slot::New(p));
                    }
                    return None;
                }
                _ = returned => {}
                _ = tokio::time::sleep_until(deadline) => return None,
            }
        }
    }
}
