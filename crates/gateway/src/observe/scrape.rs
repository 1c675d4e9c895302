//! The part of `/metrics` read when scraped: responses by status code, and the figures
//! the parts of the gateway keep themselves (the cache, upstream pools, the cluster link,
//! limit cells), each through the [`Report`] it registered: observability imports none
//! of them.

use parking_lot::Mutex;
use prometheus_client::collector::Collector;
pub use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::encoding::{EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Responses by status code.
#[derive(Debug)]
pub(super) struct Codes(pub(super) Vec<AtomicU64>);

/// A part of the gateway that keeps figures of its own, read when `/metrics` is scraped.
pub trait Report: Send + Sync + std::fmt::Debug {
    /// Writes the part's figures.
    fn report(&self, e: &mut DescriptorEncoder<'_>) -> std::fmt::Result;
}

/// Encodes what is read at scrape time.
#[derive(Debug)]
pub(super) struct Scraped {
    pub(super) codes: Arc<Codes>,
    pub(super) reports: Arc<Mutex<Vec<Arc<dyn Report>>>>,
}

/// A counter read now.
pub fn counter(e: &mut DescriptorEncoder, name: &str, help: &str, v: u64) -> std::fmt::Result {
    ConstCounter::new(v).encode(e.encode_descriptor(name, help, None, MetricType::Counter)?)
}

/// A gauge read now.
pub fn gauge(e: &mut DescriptorEncoder, name: &str, help: &str, v: u64) -> std::fmt::Result {
    let v = i64::try_from(v).unwrap_or(i64::MAX);
    ConstGauge::new(v).encode(e.encode_descriptor(name, help, None, MetricType::Gauge)?)
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CodeLabel {
    code: u16,
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
        for r in self.reports.lock().iter() {
            r.report(&mut e)?;
        }
        Ok(())
    }
}
