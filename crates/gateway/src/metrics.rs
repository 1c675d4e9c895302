//! Counters for `/metrics`, in the Prometheus text format. The request path only does an
//! atomic add; the text is made when scraped.

use crate::cache::store::Store;
use crate::cluster::Cluster;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

/// Process-wide counters.
#[derive(Debug)]
pub struct Metrics {
    responses: Vec<AtomicU64>,
    /// Configs rejected by reloads.
    pub reload_errors: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            responses: (0..600).map(|_| AtomicU64::new(0)).collect(),
            reload_errors: AtomicU64::new(0),
        }
    }
}

impl Metrics {
    /// Counts a response by status code.
    pub fn response(&self, status: u16) {
        if let Some(c) = self.responses.get(usize::from(status)) {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The exposition text. `reloads` is the number of configs applied since start-up.
    pub fn render(&self, reloads: u64, cluster: Option<&Cluster>, cache: &Store) -> String {
        let mut o = String::new();
        o.push_str("# HELP tollgate_responses_total Responses sent, by status code.\n");
        o.push_str("# TYPE tollgate_responses_total counter\n");
        for (code, c) in self.responses.iter().enumerate() {
            let n = c.load(Ordering::Relaxed);
            if n > 0 {
                let _ = writeln!(o, "tollgate_responses_total{{code=\"{code}\"}} {n}");
            }
        }
        let mut metric = |kind: &str, name: &str, help: &str, v: u64| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}");
        };
        let errors = self.reload_errors.load(Ordering::Relaxed);
        metric(
            "counter",
            "tollgate_config_reloads_total",
            "Configs applied by reloads.",
            reloads,
        );
        metric(
            "counter",
            "tollgate_config_reload_errors_total",
            "Configs rejected by reloads (the old config kept serving).",
            errors,
        );
        let (entries, bytes) = cache.usage();
        let cm = &cache.metrics;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        for (kind, name, help, v) in [
            (
                "gauge",
                "tollgate_cache_entries",
                "Responses stored.",
                entries,
            ),
            (
                "gauge",
                "tollgate_cache_bytes",
                "Bytes the stored responses take.",
                bytes,
            ),
            (
                "counter",
                "tollgate_cache_hits_total",
                "Answered from the cache.",
                load(&cm.hits),
            ),
            (
                "counter",
                "tollgate_cache_misses_total",
                "Went upstream for want of a usable entry.",
                load(&cm.misses),
            ),
            (
                "counter",
                "tollgate_cache_stale_total",
                "Answered stale (while revalidating, or the upstream failed).",
                load(&cm.stale),
            ),
            (
                "counter",
                "tollgate_cache_revalidated_total",
                "Stale entries renewed by a 304.",
                load(&cm.revalidated),
            ),
            (
                "counter",
                "tollgate_cache_coalesced_total",
                "Answered from another request's fetch of the same key.",
                load(&cm.coalesced),
            ),
            (
                "counter",
                "tollgate_cache_stored_total",
                "Responses stored.",
                load(&cm.stored),
            ),
            (
                "counter",
                "tollgate_cache_evictions_total",
                "Entries evicted to make room.",
                load(&cm.evictions),
            ),
            (
                "counter",
                "tollgate_cache_purged_total",
                "Entries removed by purges and unsafe methods.",
                load(&cm.purged),
            ),
        ] {
            metric(kind, name, help, v);
        }
        if let Some(c) = cluster {
            let m = &c.metrics;
            for (kind, name, help, v) in [
                (
                    "gauge",
                    "tollgate_cluster_redis_up",
                    "Whether the last exchange with Redis succeeded.",
                    u64::from(c.is_up()),
                ),
                (
                    "gauge",
                    "tollgate_cluster_nodes",
                    "Live nodes sharing the limits.",
                    c.nodes(),
                ),
                (
                    "counter",
                    "tollgate_cluster_rounds_total",
                    "Sync rounds with Redis, failed ones included.",
                    c.rounds_done(),
                ),
                (
                    "counter",
                    "tollgate_cluster_redis_errors_total",
                    "Failed rounds and connection attempts.",
                    load(&m.errors),
                ),
                (
                    "counter",
                    "tollgate_cluster_granted_total",
                    "Tokens granted to this node.",
                    load(&m.granted),
                ),
                (
                    "counter",
                    "tollgate_cluster_overadmitted_total",
                    "Requests admitted on credit that Redis could not grant.",
                    load(&m.overadmitted),
                ),
                (
                    "counter",
                    "tollgate_cluster_fail_open_admitted_total",
                    "Requests admitted while Redis was unreachable.",
                    load(&m.fail_open_admitted),
                ),
            ] {
                metric(kind, name, help, v);
            }
        }
        o
    }
}
