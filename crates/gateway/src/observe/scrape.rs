//! The part of `/metrics` read when scraped: responses by status code, upstream pool
//! sizes, and the figures the cache and the cluster link keep themselves.

use super::metrics::{Codes, Live};
use crate::upstream::Upstream;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

/// Encodes what is read at scrape time.
#[derive(Debug)]
pub(super) struct Scraped {
    pub(super) codes: Arc<Codes>,
    pub(super) live: Arc<Live>,
}

fn counter(e: &mut DescriptorEncoder, name: &str, help: &str, v: u64) -> std::fmt::Result {
    ConstCounter::new(v).encode(e.encode_descriptor(name, help, None, MetricType::Counter)?)
}

fn gauge(e: &mut DescriptorEncoder, name: &str, help: &str, v: u64) -> std::fmt::Result {
    let v = i64::try_from(v).unwrap_or(i64::MAX);
    ConstGauge::new(v).encode(e.encode_descriptor(name, help, None, MetricType::Gauge)?)
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CodeLabel {
    code: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TargetLabels {
    upstream: String,
    target: String,
}

impl Collector for Scraped {
    fn encode(&self, mut e: DescriptorEncoder) -> std::fmt::Result {
        {
            let mut m = e.encode_descriptor(
                "responses",
                "Responses sent, by status code.",
                None,
                MetricType::Counter,
            )?;
            for (code, c) in self.codes.0.iter().enumerate() {
                let n = c.load(Ordering::Relaxed);
                if n > 0 {
                    let l = CodeLabel {
                        code: u16::try_from(code).unwrap_or(0),
                    };
                    ConstCounter::new(n).encode(m.encode_family(&l)?)?;
                }
            }
        }
        let ups: Vec<Arc<Upstream>> = self
            .live
            .upstreams
            .lock()
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        for (name, help, which) in [
            (
                "upstream_connections",
                "Upstream connections open now, by target.",
                0,
            ),
            (
                "upstream_idle_connections",
                "Kept-alive upstream connections waiting in the pool, by target.",
                1,
            ),
            (
                "upstream_target_healthy",
                "1 while a target is in rotation, 0 while health checks keep it out.",
                2,
            ),
        ] {
            let mut m = e.encode_descriptor(name, help, None, MetricType::Gauge)?;
            let mut seen = std::collections::HashSet::new();
            for up in &ups {
                for (target, open, idle_n, up_now) in up.pool_figures() {
                    let l = TargetLabels {
                        upstream: up.cfg.name.clone(),
                        target,
                    };
                    if seen.insert(l.clone()) {
                        let v = match which {
                            0 => open,
                            1 => idle_n,
                            _ => usize::from(up_now),
                        };
                        ConstGauge::new(i64::try_from(v).unwrap_or(i64::MAX))
                            .encode(m.encode_family(&l)?)?;
                    }
                }
            }
        }
        if let Some(cells) = self.live.limit_cells.get().and_then(Weak::upgrade) {
            gauge(
                &mut e,
                "limit_cells",
                "Limit counter cells in use (made when a consumer calls again within a window, retired once idle).",
                cells.len() as u64,
            )?;
        }
        if let Some(st) = self.live.state.get() {
            let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
            counter(
                &mut e,
                "state_flushes",
                "Rounds of writing limit counters to the state file (written or found nothing to write).",
                load(&st.flushes),
            )?;
            counter(
                &mut e,
                "state_windows_written",
                "Limit windows written to the state file.",
                load(&st.windows),
            )?;
            counter(
                &mut e,
                "state_errors",
                "State file opens or writes that failed (the gateway keeps serving).",
                load(&st.errors),
            )?;
        }
        if let Some(cache) = self.live.cache.get() {
            let store = &cache.store;
            let (entries, bytes) = store.usage();
            let cm = &store.metrics;
            let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
            gauge(&mut e, "cache_entries", "Responses stored.", entries)?;
            gauge(
                &mut e,
                "cache_bytes",
                "Bytes the stored responses take.",
                bytes,
            )?;
            gauge(
                &mut e,
                "cache_index_uris",
                "URIs with something stored, in the cache's index.",
                store.index_len() as u64,
            )?;
            for (name, help, v) in [
                ("cache_hits", "Answered from the cache.", &cm.hits),
                (
                    "cache_misses",
                    "Went upstream for want of a usable entry.",
                    &cm.misses,
                ),
                (
                    "cache_stale",
                    "Answered stale (while revalidating, or the upstream failed).",
                    &cm.stale,
                ),
                (
                    "cache_revalidated",
                    "Stale entries renewed by a 304.",
                    &cm.revalidated,
                ),
                (
                    "cache_coalesced",
                    "Answered from another request's fetch of the same key.",
                    &cm.coalesced,
                ),
                ("cache_stored", "Responses stored.", &cm.stored),
                (
                    "cache_evictions",
                    "Entries evicted to make room.",
                    &cm.evictions,
                ),
                (
                    "cache_purged",
                    "Entries removed by purges and unsafe methods.",
                    &cm.purged,
                ),
            ] {
                counter(&mut e, name, help, load(v))?;
            }
        }
        if let Some(c) = self.live.cluster.get() {
            let m = &c.metrics;
            let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
            gauge(
                &mut e,
                "cluster_redis_up",
                "Whether the last exchange with Redis succeeded.",
                u64::from(c.is_up()),
            )?;
            gauge(
                &mut e,
                "cluster_nodes",
                "Live nodes sharing the limits.",
                c.nodes(),
            )?;
            gauge(
                &mut e,
                "cluster_sync_latency_microseconds",
                "Duration of the last successful sync round with Redis.",
                c.last_round_micros(),
            )?;
            counter(
                &mut e,
                "cluster_rounds",
                "Sync rounds with Redis, failed ones included.",
                c.rounds_done(),
            )?;
            for (name, help, v) in [
                (
                    "cluster_redis_errors",
                    "Failed rounds and connection attempts.",
                    &m.errors,
                ),
                (
                    "cluster_granted",
                    "Tokens granted to this node.",
                    &m.granted,
                ),
                (
                    "cluster_overadmitted",
                    "Requests admitted on credit that Redis could not grant.",
                    &m.overadmitted,
                ),
                (
                    "cluster_fail_open_admitted",
                    "Requests admitted while Redis was unreachable.",
                    &m.fail_open_admitted,
                ),
            ] {
                counter(&mut e, name, help, load(v))?;
            }
        }
        Ok(())
    }
}
