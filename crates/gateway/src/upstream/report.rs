//! The upstreams' pool figures for `/metrics`: connections open and idle, and whether each
//! target is in rotation, for every upstream some snapshot still uses.

use super::target::Upstream;
use crate::observe::scrape::{DescriptorEncoder, Report};
use parking_lot::Mutex;
use prometheus_client::encoding::{EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use std::sync::{Arc, Weak};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TargetLabels {
    upstream: String,
    target: String,
}

/// The upstreams in use, weakly held: an upstream no snapshot uses drops out.
#[derive(Debug, Default)]
pub struct Pools(Mutex<Vec<Weak<Upstream>>>);

impl Pools {
    /// Reports `up` while it is in use.
    pub fn watch(&self, up: &Arc<Upstream>) {
        let mut ups = self.0.lock();
        ups.retain(|w| w.strong_count() > 0);
        ups.push(Arc::downgrade(up));
    }
}

impl Report for Pools {
    fn report(&self, e: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
        let ups: Vec<Arc<Upstream>> = self.0.lock().iter().filter_map(Weak::upgrade).collect();
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
        Ok(())
    }
}
