//! Counters for `/metrics`, in the Prometheus text format. The request path only does an
//! atomic add; the text is made when scraped.

use crate::cluster::Cluster;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

/// Process-wide counters.
#[derive(Debug)]
pub struct Metrics {
    responses: Vec<AtomicU64>,
    /// Configs applied by reloads.
    pub reloads: AtomicU64,
    /// Configs rejected by reloads.
    pub reload_errors: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            responses: (0..600).map(|_| AtomicU64::new(0)).collect(),
            reloads: AtomicU64::new(0),
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

    /// The exposition text.
    pub fn render(&self, cluster: Option<&Cluster>) -> String {
        let mut o = String::new();
        o.push_str("# HELP tollgate_responses_total Responses sent, by status code.\n");
        o.push_str("# TYPE tollgate_responses_total counter\n");
        for (code, c) in self.responses.iter().enumerate() {
            let n = c.load(Ordering::Relaxed);
            if n > 0 {
                let _ = writeln!(o, "tollgate_responses_total{{code=\"{code}\"}} {n}");
            }
        }
        let counter = |o: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        };
        counter(
            &mut o,
            "tollgate_config_reloads_total",
            "Configs applied by reloads.",
            self.reloads.load(Ordering::Relaxed),
        );
        counter(
            &mut o,
            "tollgate_config_reload_errors_total",
            "Configs rejected by reloads (the old config kept serving).",
            self.reload_errors.load(Ordering::Relaxed),
        );
        if let Some(c) = cluster {
            let m = &c.metrics;
            let _ = writeln!(
                o,
                "# HELP tollgate_cluster_redis_up Whether the last exchange with Redis succeeded.\n# TYPE tollgate_cluster_redis_up gauge\ntollgate_cluster_redis_up {}",
                u8::from(c.is_up())
            );
            let _ = writeln!(
                o,
                "# HELP tollgate_cluster_nodes Live nodes sharing the limits.\n# TYPE tollgate_cluster_nodes gauge\ntollgate_cluster_nodes {}",
                c.nodes()
            );
            counter(
                &mut o,
                "tollgate_cluster_rounds_total",
                "Sync rounds with Redis.",
                m.rounds.load(Ordering::Relaxed),
            );
            counter(
                &mut o,
                "tollgate_cluster_redis_errors_total",
                "Failed rounds and connection attempts.",
                m.errors.load(Ordering::Relaxed),
            );
            counter(
                &mut o,
                "tollgate_cluster_granted_total",
                "Tokens granted to this node.",
                m.granted.load(Ordering::Relaxed),
            );
            counter(
                &mut o,
                "tollgate_cluster_overadmitted_total",
                "Requests admitted on credit that Redis could not grant.",
                m.overadmitted.load(Ordering::Relaxed),
            );
            counter(
                &mut o,
                "tollgate_cluster_fail_open_admitted_total",
                "Requests admitted while Redis was unreachable.",
                m.fail_open_admitted.load(Ordering::Relaxed),
            );
        }
        o
    }
}
