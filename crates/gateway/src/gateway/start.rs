//! Start-up: the parts a gateway is wired from, once, in order (cluster link, state file,
//! limit cells, registry, logs, usage history, span exporter, snapshot, cache), and the
//! sweeper thread.

use super::state::{Gateway, ReloadStatus};
use crate::cache::Cache;
use crate::clock::Clock;
use crate::cluster::{spawn_syncer, Cluster};
use crate::limiter::live::Live;
use crate::limiter::persist::StateStore;
use crate::observe::access_log::AccessLog;
use crate::observe::analytics::{self, Analytics};
use crate::observe::metrics::Metrics;
use crate::snapshot::{Registry, Snapshot};
use arc_swap::{ArcSwap, ArcSwapOption};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tollgate_config::Config;

/// How often limit cells whose windows have all passed are retired.
const SWEEP_EVERY: Duration = Duration::from_secs(10);

/// Retires idle limit cells every [`SWEEP_EVERY`] on a thread of its own, until the gateway
/// is gone.
fn spawn_sweeper(gw: std::sync::Weak<Gateway>) {
    let spawned = std::thread::Builder::new()
        .name("tollgate-sweep".into())
        .spawn(move || loop {
            std::thread::park_timeout(SWEEP_EVERY);
            let Some(gw) = gw.upgrade() else { return };
            gw.sweep();
        });
    if let Err(e) = spawned {
        tracing::error!("cannot start the limit sweeper thread: {e}; idle counters are kept");
    }
}

impl Gateway {
    /// Waits (at most `wait`) for the first fetch of every token route's signing keys, so
    /// that serving starts with them.
    pub async fn keys_settled(&self, wait: std::time::Duration) {
        let snap = self.snapshot.load_full();
        snap.keys_settled(wait).await;
    }

    /// A gateway serving `config`, counting time with `clock`.
    /// With `cluster:` in the config, limits are shared through Redis and the syncer task
    /// starts (this must run inside a tokio runtime).
    pub fn new(config: Config, clock: Arc<dyn Clock>) -> Arc<Self> {
        let metrics = Arc::new(Metrics::new());
        let cluster = config.cluster.clone().map(|c| {
            let cluster = Cluster::new(c);
            spawn_syncer(cluster.clone(), clock.clone());
            metrics.report(cluster.clone());
            cluster
        });
        let mut state_error = None;
        let state = match (&config.state, &cluster) {
            (Some(_), Some(_)) => {
                tracing::warn!(
                    "with `cluster:`, limit counters live in Redis; `state.path` is not used"
                );
                None
            }
            (Some(s), None) => match StateStore::open(s, clock.clone()) {
                Ok((store, saved)) => {
                    store.spawn_flusher(s.flush_interval);
                    metrics.report(store.stats.clone());
                    Some((store, saved))
                }
                Err(e) => {
                    state_error = Some(e.to_string());
                    None
                }
            },
            (None, _) => None,
        };
        let live = Arc::new(Live::new(
            cluster.clone().map(|c| {
                c as Arc<dyn crate::limiter::shared::SharedStore<crate::limiter::LimitCell>>
            }),
            state.as_ref().map(|(s, _)| s.queue.clone()),
        ));
        metrics.report(Arc::new(crate::limiter::report::CellCount(Arc::downgrade(
            &live,
        ))));
        let state = state.map(|(store, saved)| {
            live.restore(saved);
            store
        });
        let roster = match &config.consumers_log {
            None => {
                // Only where the API can change consumers: it needs a token.
                if config.admin.as_ref().is_some_and(|a| a.token.is_some()) {
                    tracing::warn!(
                        "consumers managed through the admin API are kept in memory only and lost on restart; name a file in consumers_log: to keep them"
                    );
                }
                crate::roster::Roster::in_memory()
            }
            // The default log beside the config file, in a folder the gateway may not write
            // (one read-only to its user): its changes are kept in memory, as before there
            // was a default, instead of being refused one by one.
            Some(path)
                if config.consumers_log_implied
                    && std::fs::OpenOptions::new()
                        .create(true)
                        .append(true)
                        .open(path)
                        .is_err() =>
            {
                tracing::warn!(
                    path = %path.display(),
                    "cannot write the consumer change log beside the config file; consumers managed through the admin API are kept in memory only and lost on restart; name a writable file in consumers_log: to keep them"
                );
                crate::roster::Roster::in_memory()
            }
            Some(path) => crate::roster::Roster::open(path).unwrap_or_else(|e| {
                let why = format!(
                    "cannot keep the consumer change log {}: {e}",
                    path.display()
                );
                // The default log beside the config file, where it cannot be kept (a
                // read-only folder, another gateway run from the same file): as before
                // there was a default. One that is there but damaged stops the start,
                // as a named one does.
                use std::io::ErrorKind as K;
                let unkeepable = matches!(
                    e.kind(),
                    K::PermissionDenied | K::ReadOnlyFilesystem | K::NotFound | K::ResourceBusy
                );
                if config.consumers_log_implied && unkeepable {
                    tracing::warn!(
                        "{why}; consumers managed through the admin API are kept in memory only and lost on restart; name a writable file in consumers_log: to keep them"
                    );
                    return crate::roster::Roster::in_memory();
                }
                tracing::error!("{why}");
                crate::roster::Roster::unavailable(why)
            }),
        };
        // Said only where something can make the log: the admin API (it needs a token)
        // or another node's changes.
        let can_change =
            config.admin.as_ref().is_some_and(|a| a.token.is_some()) || config.cluster.is_some();
        if let (true, true, Some(path)) = (roster.new_log(), can_change, &config.consumers_log) {
            let folder = path.parent().filter(|f| !f.as_os_str().is_empty());
            if folder.is_some_and(|f| !f.is_dir()) {
                tracing::warn!(
                    path = %path.display(),
                    "the folder of consumers_log does not exist: changes through the admin API are refused (503) until it is made"
                );
            } else {
                tracing::info!(
                    path = %path.display(),
                    "no consumer change log yet: the first change through the admin API makes it"
                );
            }
        }
        let roster = Arc::new(roster);
        if let (Some(c), Ok(_)) = (&config.cluster, tokio::runtime::Handle::try_current()) {
            crate::roster::share::spawn(&roster, c);
        }
        let registry = Registry::with_live(live, cluster, metrics.clone()).with_roster(roster);
        let access_log = config
            .access_log
            .as_ref()
            .map(|c| AccessLog::start(c, metrics.clone()));
        let (analytics, analytics_error) = match &config.analytics {
            None => (None, None),
            Some(a) => match Analytics::open(a, config.cluster.as_ref(), metrics.clone()) {
                Ok(an) => {
                    let c = clock.clone();
                    analytics::spawn_flusher(&an, move || c.wall_nanos() / 1_000_000_000);
                    (Some(an), None)
                }
                Err(e) => {
                    // A required history stops the start: the caller says so.
                    if !a.required {
                        tracing::error!("{e}; serving without usage history");
                    }
                    (None, Some(e.to_string()))
                }
            },
        };
        let runtime = tokio::runtime::Handle::try_current().ok();
        let spans = match (&config.tracing, &runtime) {
            (Some(t), Some(rt)) => {
                Some(crate::observe::trace::Spans::start(t, metrics.clone(), rt))
            }
            (Some(_), None) => {
                tracing::error!("tracing: no runtime to export spans on; traces are off");
                None
            }
            (None, _) => None,
        };
        let snapshot = Snapshot::build(config, &registry);
        let (status, _) = watch::channel(ReloadStatus {
            generation: 1,
            last_error: None,
        });
        let cache = Cache::new(
            snapshot.config.cache.max_size,
            snapshot.config.cache.max_object_size,
        );
        metrics.report(cache.clone());
        // Admin and cluster changes take effect at a restart: what this gateway starts
        // with says whether keys may come from the admin API until then.
        let manages_keys = snapshot.config.admin.is_some() || snapshot.config.cluster.is_some();
        let gw = Arc::new(Gateway {
            manages_keys,
            snapshot: ArcSwap::from_pointee(snapshot),
            cache,
            running: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            registry,
            clock,
            status,
            metrics,
            access_log: ArcSwapOption::new(access_log),
            spans: ArcSwapOption::new(spans),
            runtime,
            analytics,
            analytics_error,
            started: Instant::now(),
            source: parking_lot::Mutex::new(None),
            running_text: parking_lot::Mutex::new(None),
            state,
            state_error,
            series: Default::default(),
        });
        spawn_sweeper(Arc::downgrade(&gw));
        gw
    }
}
