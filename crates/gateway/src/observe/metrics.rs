//! `/metrics`: Prometheus counters, gauges and histograms through `prometheus-client`.
//!
//! The request path touches handles resolved ahead of time (a route's counters live in its
//! [`RouteStats`], a limit's refusal counter in the snapshot), so a request costs a few
//! atomic adds and two histogram observations, never a label lookup. Figures owned by other
//! parts (the cache, the cluster link, upstream pools) are read when scraped. Every label
//! comes from the config (route, upstream, limit and, only with `metrics.per_consumer`,
//! consumer names) or a fixed list, so the number of series is bounded by the config.

use super::scrape::{Codes, Report};
use crate::exchange::REASONS;
use crate::observe::CLASSES;
use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

/// The content type of the exposition text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Methods with a series of their own; the rest count as `other`.
const METHODS: [&str; 8] = [
    "GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "other",
];

fn method_index(m: &http::Method) -> usize {
    METHODS
        .iter()
        .position(|n| *n == m.as_str())
        .unwrap_or(METHODS.len() - 1)
}

/// Latency buckets, seconds: 250 µs to 60 s (the default `response_timeout`: a timed-out
/// request lands in a bucket of its own, not only in `+Inf`).
fn latency() -> Histogram {
    Histogram::new([
        0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
        10.0, 30.0, 60.0,
    ])
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    route: String,
    method: &'static str,
    class: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabel {
    route: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LimitLabel {
    limit: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ConsumerLabels {
    consumer: String,
    class: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct UpstreamLabel {
    upstream: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DropLabel {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FailureLabels {
    upstream: String,
    kind: &'static str,
}

/// One route's counters and histograms, kept across reloads by route name.
#[derive(Debug)]
pub struct RouteStats {
    /// The route's name ("" for requests no route took).
    pub name: Arc<str>,
    requests: [[OnceLock<Counter>; 5]; METHODS.len()],
    family: Family<RequestLabels, Counter>,
    duration: Histogram,
    upstream: Histogram,
}

impl RouteStats {
    /// Counts a response: by method and status class, and its time to the response head.
    pub fn record(&self, method: &http::Method, status: u16, secs: f64) {
        let m = method_index(method);
        let c = super::class_index(status);
        self.requests[m][c]
            .get_or_init(|| {
                self.family
                    .get_or_create(&RequestLabels {
                        route: self.name.to_string(),
                        method: METHODS[m],
                        class: CLASSES[c],
                    })
                    .clone()
            })
            .inc();
        self.duration.observe(secs);
    }

    /// Records the wait for an upstream's response head.
    pub fn upstream(&self, secs: f64) {
        self.upstream.observe(secs);
    }
}

/// One upstream's failure counters, kept across reloads by upstream name.
#[derive(Debug, Clone, Default)]
pub struct UpstreamStats {
    /// Connections that could not be opened.
    pub connect_errors: Counter,
    /// Requests sent again, on another connection or target.
    pub retries: Counter,
    /// Requests answered 504 for want of an answer in time.
    pub timeouts: Counter,
    /// Requests answered 502 (reset, closed or malformed answers, no target reachable).
    pub errors: Counter,
    /// Requests answered 503 because every allowed connection was busy.
    pub busy: Counter,
    /// Requests answered 503 because no target was healthy.
    pub no_healthy: Counter,
    /// Times a target was taken out of rotation by health checks.
    pub taken_out: Counter,
}

/// Process-wide metrics.
#[derive(Debug)]
pub struct Metrics {
    /// The families the dashboard's series sample ([`Metrics::render_series`]).
    series: Registry,
    registry: Registry,
    codes: Arc<Codes>,
    requests: Family<RequestLabels, Counter>,
    duration: Family<RouteLabel, Histogram, fn() -> Histogram>,
    upstream_duration: Family<RouteLabel, Histogram, fn() -> Histogram>,
    refusals: Vec<Counter>,
    limit_refusals: Family<LimitLabel, Counter>,
    per_consumer: Family<ConsumerLabels, Counter>,
    failures: Family<FailureLabels, Counter>,
    connect_errors: Family<UpstreamLabel, Counter>,
    retries: Family<UpstreamLabel, Counter>,
    taken_out: Family<UpstreamLabel, Counter>,
    /// Client connections open now.
    pub connections_open: Gauge,
    /// Client connections accepted.
    pub connections_total: Counter,
    /// TLS connections that never reached HTTP: failed or stalled handshakes, plain HTTP.
    pub tls_failures: Counter,
    /// Upgraded connections (WebSocket) joined to an upstream.
    pub upgrades: Counter,
    /// Upgraded connections open now.
    pub upgrades_open: Gauge,
    /// Configs applied by reloads.
    pub reloads: Counter,
    /// Configs rejected by reloads.
    pub reload_errors: Counter,
    /// Access log lines written.
    pub log_lines: Counter,
    /// Access log lines dropped because the writer could not keep up or could not write.
    pub log_dropped: Counter,
    /// Access log write or open failures.
    pub log_errors: Counter,
    /// Usage-history batches that could not be stored.
    pub analytics_errors: Counter,
    /// Spans sent to the collector.
    pub trace_exported: Counter,
    /// Spans dropped because the export queue was full.
    pub trace_dropped_full: Counter,
    /// Spans dropped because their export failed or timed out.
    pub trace_dropped_failed: Counter,
    routes: Mutex<HashMap<String, Arc<RouteStats>>>,
    upstreams: Mutex<HashMap<String, UpstreamStats>>,
    unrouted: Arc<RouteStats>,
    reports: Arc<Mutex<Vec<Arc<dyn Report>>>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    /// Empty metrics, registered under the `tollgate_` prefix.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("tollgate");
        let codes = Arc::new(Codes((0..600).map(|_| AtomicU64::new(0)).collect()));
        let reports = Arc::new(Mutex::new(Vec::new()));
        registry.register_collector(Box::new(super::scrape::Scraped {
            codes: codes.clone(),
            reports: reports.clone(),
        }));
        // Help texts end without a period: the encoder adds one.
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "requests",
            "Requests answered, by route, method and status class",
            requests.clone(),
        );
        let duration: Family<RouteLabel, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(latency);
        registry.register(
            "request_duration_seconds",
            "Time from the request head to the response head, by route",
            duration.clone(),
        );
        let upstream_duration: Family<RouteLabel, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(latency);
        registry.register(
            "upstream_duration_seconds",
            "Time waiting for the upstream's response head, by route",
            upstream_duration.clone(),
        );
        let by_reason = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "refusals",
            "Requests the gateway answered itself, by reason",
            by_reason.clone(),
        );
        let refusals = REASONS
            .iter()
            .map(|r| by_reason.get_or_create(&ReasonLabel { reason: r }).clone())
            .collect();
        let limit_refusals = Family::<LimitLabel, Counter>::default();
        registry.register(
            "limit_refusals",
            "Requests refused with 429, by the limit that refused",
            limit_refusals.clone(),
        );
        let per_consumer = Family::<ConsumerLabels, Counter>::default();
        registry.register(
            "consumer_requests",
            "Requests by consumer and status class (with metrics.per_consumer)",
            per_consumer.clone(),
        );
        let failures = Family::<FailureLabels, Counter>::default();
        registry.register(
            "upstream_failures",
            "Requests that got no usable answer from the upstream (kind: error 502, timeout 504, busy 503)",
            failures.clone(),
        );
        let connect_errors = Family::<UpstreamLabel, Counter>::default();
        registry.register(
            "upstream_connect_errors",
            "Upstream connections that could not be opened",
            connect_errors.clone(),
        );
        let retries = Family::<UpstreamLabel, Counter>::default();
        registry.register(
            "upstream_retries",
            "Requests sent again on another connection or target",
            retries.clone(),
        );
        let taken_out = Family::<UpstreamLabel, Counter>::default();
        registry.register(
            "upstream_targets_taken_out",
            "Times a target was taken out of rotation by passive or active health checks",
            taken_out.clone(),
        );
        let connections_open = Gauge::default();
        registry.register(
            "client_connections",
            "Client connections open now",
            connections_open.clone(),
        );
        let connections_total = Counter::default();
        registry.register(
            "client_connections_accepted",
            "Client connections accepted",
            connections_total.clone(),
        );
        let tls_failures = Counter::default();
        registry.register(
            "tls_handshake_failures",
            "TLS connections that never reached HTTP: failed or stalled handshakes, plain HTTP",
            tls_failures.clone(),
        );
        let upgrades = Counter::default();
        registry.register(
            "upgrades",
            "Connections upgraded (WebSocket) and joined to an upstream",
            upgrades.clone(),
        );
        let upgrades_open = Gauge::default();
        registry.register(
            "upgrades_open",
            "Upgraded connections open now",
            upgrades_open.clone(),
        );
        let reloads = Counter::default();
        registry.register(
            "config_reloads",
            "Configs applied by reloads",
            reloads.clone(),
        );
        let reload_errors = Counter::default();
        registry.register(
            "config_reload_errors",
            "Configs rejected by reloads (the old config kept serving)",
            reload_errors.clone(),
        );
        let log_lines = Counter::default();
        registry.register(
            "access_log_lines",
            "Access log lines written",
            log_lines.clone(),
        );
        let log_dropped = Counter::default();
        registry.register(
            "access_log_dropped",
            "Access log lines dropped: the writer fell behind or could not write",
            log_dropped.clone(),
        );
        let log_errors = Counter::default();
        registry.register(
            "access_log_errors",
            "Access log files that could not be opened or written",
            log_errors.clone(),
        );
        let analytics_errors = Counter::default();
        registry.register(
            "analytics_errors",
            "Usage-history batches that could not be stored",
            analytics_errors.clone(),
        );
        let trace_exported = Counter::default();
        registry.register(
            "trace_spans_exported",
            "Spans sent to the OTLP collector",
            trace_exported.clone(),
        );
        let trace_dropped = Family::<DropLabel, Counter>::default();
        registry.register(
            "trace_spans_dropped",
            "Spans dropped: the export queue was full, or their export failed",
            trace_dropped.clone(),
        );
        let trace_dropped_full = trace_dropped
            .get_or_create(&DropLabel {
                reason: "queue_full",
            })
            .clone();
        let trace_dropped_failed = trace_dropped
            .get_or_create(&DropLabel {
                reason: "export_failed",
            })
            .clone();
        let unrouted = Arc::new(route_stats("", &requests, &duration, &upstream_duration));
        // The dashboard's series read these two families only, once a second: the full
        // exposition (live collectors, per-consumer families) is for scrapes.
        let mut series = Registry::with_prefix("tollgate");
        series.register("requests", "Requests answered", requests.clone());
        series.register(
            "request_duration_seconds",
            "Time to the response head",
            duration.clone(),
        );
        Metrics {
            series,
            registry,
            codes,
            requests,
            duration,
            upstream_duration,
            refusals,
            limit_refusals,
            per_consumer,
            failures,
            connect_errors,
            retries,
            taken_out,
            connections_open,
            connections_total,
            tls_failures,
            upgrades,
            upgrades_open,
            reloads,
            reload_errors,
            log_lines,
            log_dropped,
            log_errors,
            analytics_errors,
            trace_exported,
            trace_dropped_full,
            trace_dropped_failed,
            routes: Mutex::new(HashMap::new()),
            upstreams: Mutex::new(HashMap::new()),
            unrouted,
            reports,
        }
    }

    /// Reads `part`'s own figures whenever `/metrics` is scraped (the cache, upstream
    /// pools, the cluster link, the limiter register theirs).
    pub fn report(&self, part: Arc<dyn Report>) {
        self.reports.lock().push(part);
    }

    /// Counts a response by status code.
    pub fn response(&self, status: u16) {
        if let Some(c) = self.codes.0.get(usize::from(status)) {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The counters of the route named `name`, the same across reloads.
    pub fn route(&self, name: &str) -> Arc<RouteStats> {
        self.routes
            .lock()
            .entry(name.to_string())
            .or_insert_with(|| {
                Arc::new(route_stats(
                    name,
                    &self.requests,
                    &self.duration,
                    &self.upstream_duration,
                ))
            })
            .clone()
    }

    /// The counters of requests no route took (404, and 400 before routing).
    pub fn unrouted(&self) -> &Arc<RouteStats> {
        &self.unrouted
    }

    /// The failure counters of the upstream named `name`.
    pub fn upstream(&self, name: &str) -> UpstreamStats {
        self.upstreams
            .lock()
            .entry(name.to_string())
            .or_insert_with(|| {
                let l = UpstreamLabel {
                    upstream: name.to_string(),
                };
                let kind = |k| {
                    self.failures
                        .get_or_create(&FailureLabels {
                            upstream: name.to_string(),
                            kind: k,
                        })
                        .clone()
                };
                UpstreamStats {
                    connect_errors: self.connect_errors.get_or_create(&l).clone(),
                    retries: self.retries.get_or_create(&l).clone(),
                    timeouts: kind("timeout"),
                    errors: kind("error"),
                    busy: kind("busy"),
                    no_healthy: kind("no_healthy_target"),
                    taken_out: self.taken_out.get_or_create(&l).clone(),
                }
            })
            .clone()
    }

    /// The refusal counter of a limit, by name.
    pub fn limit(&self, name: &str) -> Counter {
        self.limit_refusals
            .get_or_create(&LimitLabel {
                limit: name.to_string(),
            })
            .clone()
    }

    /// Counts a refusal by reason ([`crate::exchange::Refusal::reason_index`]).
    pub fn refusal(&self, reason: usize) {
        if let Some(c) = self.refusals.get(reason) {
            c.inc();
        }
    }

    /// Counts a request of `consumer` (only with `metrics.per_consumer`).
    pub fn consumer(&self, consumer: &str, status: u16) {
        self.per_consumer
            .get_or_create(&ConsumerLabels {
                consumer: consumer.to_string(),
                class: CLASSES[super::class_index(status)],
            })
            .inc();
    }

    /// The request count and latency families alone, as exposition text: what the
    /// dashboard's series sample.
    pub fn render_series(&self) -> String {
        let mut out = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.series);
        out
    }

    /// The exposition text (OpenMetrics, which Prometheus reads).
    pub fn render(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
            out.push_str("# EOF\n");
        }
        out
    }
}

fn route_stats(
    name: &str,
    requests: &Family<RequestLabels, Counter>,
    duration: &Family<RouteLabel, Histogram, fn() -> Histogram>,
    upstream: &Family<RouteLabel, Histogram, fn() -> Histogram>,
) -> RouteStats {
    let label = RouteLabel {
        route: name.to_string(),
    };
    RouteStats {
        name: Arc::from(name),
        requests: Default::default(),
        family: requests.clone(),
        duration: duration.get_or_create(&label).clone(),
        upstream: upstream.get_or_create(&label).clone(),
    }
}
