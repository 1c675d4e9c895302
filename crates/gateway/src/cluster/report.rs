//! The cluster link's figures for `/metrics`: whether Redis answers, the nodes, the
//! sync rounds and what was granted or admitted on credit.

use super::link::Cluster;
use crate::observe::scrape::{counter, gauge, DescriptorEncoder, Report};
use std::sync::atomic::{AtomicU64, Ordering};

impl Report for Cluster {
    fn report(&self, e: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
        let c = self;
        let m = &c.metrics;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        gauge(
            e,
            "cluster_redis_up",
            "Whether the last exchange with Redis succeeded.",
            u64::from(c.is_up()),
        )?;
        if c.is_cluster_topology() {
            gauge(
                e,
                "cluster_redis_partly_down",
                "Whether the last round with the Redis Cluster failed in part (a master down).",
                u64::from(c.is_partly_down()),
            )?;
        }
        gauge(
            e,
            "cluster_nodes",
            "Live nodes sharing the limits.",
            c.nodes(),
        )?;
        gauge(
            e,
            "cluster_sync_latency_microseconds",
            "Duration of the last successful sync round with Redis.",
            c.last_round_micros(),
        )?;
        counter(
            e,
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
            counter(e, name, help, load(v))?;
        }
        Ok(())
    }
}
