//! Idle keep-alive connections of one target, most recently used first, closed once idle
//! longer than the pool's idle timeout (ages read on the coarse clock: to within a few
//! milliseconds). Shared by both upstream clients.

use crate::clock::coarse;
use parking_lot::Mutex;
use std::sync::Weak;
use std::time::Duration;

/// A list of idle connections.
pub struct IdleList<T> {
    idle: Mutex<Vec<(T, Duration)>>,
    max_idle: usize,
    idle_timeout: Duration,
}

impl<T: Send + 'static> IdleList<T> {
    /// A list keeping at most `max_idle` connections for at most `idle_timeout`.
    pub fn new(max_idle: usize, idle_timeout: Duration) -> Self {
        IdleList {
            idle: Mutex::new(Vec::new()),
            max_idle,
            idle_timeout,
        }
    }

    /// The most recently used connection that `usable` accepts; others met on the way are
    /// dropped (closed).
    pub fn checkout(&self, usable: impl Fn(&T) -> bool) -> Option<T> {
        let mut idle = self.idle.lock();
        while let Some((conn, since)) = idle.pop() {
            if coarse::since_boot().saturating_sub(since) < self.idle_timeout && usable(&conn) {
                return Some(conn);
            }
        }
        None
    }

    /// Connections waiting in the list now.
    pub fn len(&self) -> usize {
        self.idle.lock().len()
    }

    /// Keeps a connection for reuse, unless the list is full.
    pub fn checkin(&self, conn: T) {
        let mut idle = self.idle.lock();
        if idle.len() < self.max_idle {
            idle.push((conn, coarse::since_boot()));
        }
    }

    /// Closes connections idle for too long, or that `usable` rejects.
    pub fn trim(&self, usable: impl Fn(&T) -> bool) {
        let timeout = self.idle_timeout;
        let now = coarse::since_boot();
        self.idle
            .lock()
            .retain(|(c, since)| now.saturating_sub(*since) < timeout && usable(c));
    }
}

/// Starts a task that trims the pool behind `weak` every half idle timeout, until the pool
/// is gone (when a runtime is running).
pub fn spawn_reaper<P: Send + Sync + 'static>(weak: Weak<P>, idle_timeout: Duration, trim: fn(&P)) {
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let every = (idle_timeout / 2).max(Duration::from_millis(500));
    rt.spawn(async move {
        loop {
            tokio::time::sleep(every).await;
            match weak.upgrade() {
                Some(p) => trim(&p),
                None => return,
            }
        }
    });
}
