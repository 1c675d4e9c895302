//! The key sets' figures for `/metrics`: keys held, fetches, and whether the last fetch
//! failed (the last good keys then keep serving).

use super::sets::KeyRing;
use crate::observe::scrape::{DescriptorEncoder, Report};
use prometheus_client::encoding::{EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use std::time::UNIX_EPOCH;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Source {
    source: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Outcome {
    source: String,
    result: &'static str,
}

/// One set's figures, read under its lock once per scrape.
struct Row {
    source: String,
    keys: i64,
    fetched: u64,
    failed: u64,
    stale: i64,
    refresh_in: Option<i64>,
    last_ok: Option<i64>,
}

fn gauge(
    e: &mut DescriptorEncoder<'_>,
    rows: &[Row],
    name: &str,
    help: &str,
    value: impl Fn(&Row) -> Option<i64>,
) -> std::fmt::Result {
    let mut m = e.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for r in rows {
        if let Some(v) = value(r) {
            ConstGauge::new(v).encode(m.encode_family(&Source {
                source: r.source.clone(),
            })?)?;
        }
    }
    Ok(())
}

impl Report for KeyRing {
    fn report(&self, e: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
        let mut sets = self.live();
        // In the order they were made: a set keeps its place between scrapes.
        sets.sort_by_key(|s| s.made);
        if sets.is_empty() {
            return Ok(());
        }
        let secs = |s: u64| i64::try_from(s).unwrap_or(i64::MAX);
        let mut rows: Vec<Row> = sets
            .iter()
            .map(|s| {
                let h = s.health.lock();
                Row {
                    source: s.label.clone(),
                    keys: i64::try_from(s.keys().list.len()).unwrap_or(i64::MAX),
                    fetched: h.fetched,
                    failed: h.failed,
                    stale: i64::from(h.failing.is_some()),
                    refresh_in: h.next.map(|n| {
                        secs(
                            n.saturating_duration_since(tokio::time::Instant::now())
                                .as_secs(),
                        )
                    }),
                    last_ok: h
                        .last_ok
                        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                        .map(|d| secs(d.as_secs())),
                }
            })
            .collect();
        // Two URLs shown alike (they differ in their credentials only) are told apart:
        // the same series twice would fail the whole scrape.
        let mut seen = std::collections::HashMap::<String, u32>::new();
        for r in &mut rows {
            let n = seen.entry(r.source.clone()).or_insert(0);
            *n += 1;
            if *n > 1 {
                r.source = format!("{} ({n})", r.source);
            }
        }
        gauge(
            e,
            &rows,
            "jwks_keys",
            "Token signing keys held, by source.",
            |r| Some(r.keys),
        )?;
        gauge(
            e,
            &rows,
            "jwks_stale",
            "1 while the last fetch of a key set failed (the last good keys keep serving).",
            |r| Some(r.stale),
        )?;
        gauge(
            e,
            &rows,
            "jwks_refresh_in_seconds",
            "Seconds until a key set is fetched again (its Cache-Control max-age, or the retry after a failure).",
            |r| r.refresh_in,
        )?;
        gauge(
            e,
            &rows,
            "jwks_last_success_timestamp_seconds",
            "When a key set was last fetched or read successfully.",
            |r| r.last_ok,
        )?;
        let mut m = e.encode_descriptor(
            "jwks_fetches",
            "Fetches of token signing keys (with the issuer's metadata), by result.",
            None,
            MetricType::Counter,
        )?;
        for r in &rows {
            for (result, n) in [("ok", r.fetched), ("error", r.failed)] {
                ConstCounter::new(n).encode(m.encode_family(&Outcome {
                    source: r.source.clone(),
                    result,
                })?)?;
            }
        }
        Ok(())
    }
}
