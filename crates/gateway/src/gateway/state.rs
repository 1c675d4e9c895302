//! A running gateway's state: the pinned snapshot, what outlives reloads (cache, metrics,
//! limit cells, logs), and what the admin API and the CLI read of it.

use crate::cache::Cache;
use crate::clock::Clock;
use crate::cluster::Cluster;
use crate::limiter::persist::StateStore;
use crate::limiter::Now;
use crate::observe::access_log::AccessLog;
use crate::observe::analytics::Analytics;
use crate::observe::metrics::Metrics;
use crate::snapshot::{Registry, Snapshot};
use arc_swap::{ArcSwap, ArcSwapOption};
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// Where reloads stand: a new generation after each applied config, and the last failure.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReloadStatus {
    /// Number of configs applied since start (the first is 1).
    pub generation: u64,
    /// The problem with the last rejected config, if the last attempt failed.
    pub last_error: Option<String>,
}

/// A running gateway's state: the current snapshot and what outlives it.
pub struct Gateway {
    pub(super) snapshot: ArcSwap<Snapshot>,
    /// The response cache; outlives reloads.
    pub(super) cache: Arc<Cache>,
    /// Fingerprint of the file content the running config came from.
    pub(super) running: AtomicU64,
    /// The fingerprint of the content a reload last rejected (0: none since the last
    /// success), so that the same rejection from `SIGHUP` and the watcher counts once.
    pub(super) rejected: AtomicU64,
    pub(super) registry: Registry,
    pub(super) clock: Arc<dyn Clock>,
    pub(super) status: watch::Sender<ReloadStatus>,
    pub(super) metrics: Arc<Metrics>,
    pub(super) access_log: ArcSwapOption<AccessLog>,
    /// The span exporter, when `tracing:` is set.
    pub(super) spans: ArcSwapOption<crate::observe::trace::Spans>,
    /// The runtime the gateway was made in: span exporters made by reloads run on it.
    pub(super) runtime: Option<tokio::runtime::Handle>,
    pub(super) analytics: Option<Arc<Analytics>>,
    pub(super) analytics_error: Option<String>,
    pub(super) started: Instant,
    /// The config file reloads read, when the config came from one.
    pub(super) source: parking_lot::Mutex<Option<PathBuf>>,
    /// The text of the running config, for `/config`.
    pub(super) running_text: parking_lot::Mutex<Option<Arc<[u8]>>>,
    /// Where limit counters are written, when `state:` is set.
    pub(super) state: Option<Arc<StateStore>>,
    /// Why the state file could not be kept at start (another process keeps it).
    pub(super) state_error: Option<String>,
    /// The last minutes of the request series, for the dashboard.
    pub(super) series: crate::observe::series::Series,
    /// Whether the admin API (or another node) may give keys: `admin:` or `cluster:` at
    /// start. A reload indexes the config's plain keys by digest then, whatever it says.
    pub(super) manages_keys: bool,
}

impl std::fmt::Debug for Gateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway").finish_non_exhaustive()
    }
}

impl Gateway {
    /// The metrics.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The usage history, when kept.
    pub fn analytics(&self) -> Option<&Arc<Analytics>> {
        self.analytics.as_ref()
    }

    /// Why the usage history could not be opened at start, if it could not.
    pub fn analytics_error(&self) -> Option<&str> {
        self.analytics_error.as_deref()
    }

    /// Why the state file could not be kept at start, if it could not: another gateway
    /// keeps it. This one counts in memory only; `run` does not start.
    pub fn state_error(&self) -> Option<&str> {
        self.state_error.as_deref()
    }

    /// Why the consumer change log could not be read at start, if it could not: serving
    /// without it would take back every deletion and revocation it holds.
    pub fn roster_error(&self) -> Option<String> {
        self.snapshot().roster.broken().map(str::to_string)
    }

    /// What the running config contradicts in the managed consumers (a key given to two
    /// consumers, a plan it lacks), each said as a config problem: checked at start; a
    /// reload with any is refused.
    pub fn config_conflicts(&self) -> Vec<tollgate_config::Problem> {
        let snap = self.snapshot();
        snap.roster.conflicts(&snap.config)
    }

    /// Of [`Gateway::config_conflicts`], the plans managed consumers are on that the
    /// running config lacks: such consumers are refused (503), so a start need not stop
    /// for them (a stopped node could not take the change that mends them).
    pub fn missing_plans(&self) -> Vec<tollgate_config::Problem> {
        let snap = self.snapshot();
        snap.roster.missing_plans(&snap.config)
    }

    /// Time since the gateway started.
    pub fn uptime(&self) -> Duration {
        self.started.elapsed()
    }

    /// Wall-clock seconds since the epoch, on the gateway's clock.
    pub fn wall_secs(&self) -> u64 {
        self.clock.wall_nanos() / 1_000_000_000
    }

    /// Waits until the access log lines of requests answered so far are written (at most
    /// `wait`; blocking). False when there is no access log or the wait ran out.
    pub fn sync_logs(&self, wait: Duration) -> bool {
        self.access_log.load_full().is_some_and(|l| l.sync(wait))
    }

    /// Retires limit cells whose windows have all passed, and clears them from the
    /// running snapshot. Returns how many cells were retired.
    pub fn sweep(&self) -> usize {
        let retired = self.registry.live().sweep(self.now());
        if retired > 0 {
            self.snapshot.load().counters.sweep();
        }
        retired
    }

    /// Writes the limit counters not yet in the state file (blocking). Returns how many
    /// windows were written.
    pub fn flush_state(&self) -> usize {
        self.state.as_ref().map_or(0, |s| s.flush())
    }

    /// Writes out what is still held in memory: limit counters, usage counts not yet in
    /// the database, and queued access log lines (on shutdown).
    pub async fn flush_all(&self) {
        if let Some(s) = self.state.clone() {
            s.stop();
            let _ = tokio::task::spawn_blocking(move || s.flush()).await;
        }
        if let Some(a) = &self.analytics {
            a.flush(self.wall_secs()).await;
        }
        if let Some(l) = self.access_log.load_full() {
            let _ = tokio::task::spawn_blocking(move || l.sync(Duration::from_secs(5))).await;
        }
        if let Some(s) = self.spans.load_full() {
            s.flush(Duration::from_secs(5)).await;
        }
    }

    /// Waits (at most `wait`) until the spans of requests answered so far are exported or
    /// given up. False when tracing is off or the wait ran out.
    pub async fn flush_spans(&self, wait: Duration) -> bool {
        match self.spans.load_full() {
            Some(s) => s.flush(wait).await,
            None => false,
        }
    }

    /// Reopens the access log file (`SIGUSR1`).
    pub fn reopen_logs(&self) {
        if let Some(l) = self.access_log.load_full() {
            l.reopen();
        }
    }

    /// The config file reloads read (`POST /reload`), when the config came from one.
    pub fn source(&self) -> Option<PathBuf> {
        self.source.lock().clone()
    }

    /// The text of the running config, when it came from a file.
    pub fn running_text(&self) -> Option<Arc<[u8]>> {
        self.running_text.lock().clone()
    }

    /// Where reloads stand now.
    pub fn reload_status(&self) -> ReloadStatus {
        self.status.borrow().clone()
    }

    /// Whether the last reload was refused (and nothing since has cleared it).
    pub fn reload_refused(&self) -> bool {
        self.status.borrow().last_error.is_some()
    }

    /// The current snapshot.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.snapshot.load_full()
    }

    /// The limiter's time.
    pub fn now(&self) -> Now {
        Now {
            mono: self.clock.now_nanos(),
            wall: self.clock.wall_nanos(),
        }
    }

    /// The `/metrics` text.
    pub fn metrics_text(&self) -> String {
        self.metrics.render()
    }

    /// Takes this second's sample of the request series (the admin listener does, once a
    /// second).
    pub fn sample_series(&self) {
        self.series
            .sample(self.wall_secs(), &self.metrics.render_series());
    }

    /// The last minutes of the request series, oldest first.
    pub fn series(&self) -> Vec<crate::observe::series::Sample> {
        self.series.samples()
    }

    /// The running TLS config of the listener at `address`, if it has TLS.
    pub fn tls_for(&self, address: std::net::SocketAddr) -> Option<Arc<rustls::ServerConfig>> {
        let snap = self.snapshot.load();
        snap.tls
            .iter()
            .find(|(a, _)| *a == address)
            .map(|(_, c)| c.clone())
    }

    /// The response cache.
    pub fn cache(&self) -> &Arc<Cache> {
        &self.cache
    }

    /// The cluster link, when limits are shared.
    pub fn cluster(&self) -> Option<&Arc<Cluster>> {
        self.registry.cluster()
    }

    /// Follows reloads: the generation moves after each applied config.
    pub fn reloads(&self) -> watch::Receiver<ReloadStatus> {
        self.status.subscribe()
    }
}
