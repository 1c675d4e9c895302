//! The bench report, in the seeds' terms: requests/s, successful and failed transactions,
//! statuses, errors by kind, fastest/slowest/average and percentiles; as text or JSON.

use crate::args::BenchArgs;
use crate::client::ErrorKind;
use crate::tally::Tally;
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

/// Latency figures in milliseconds.
#[derive(Debug, Serialize)]
pub struct Latency {
    pub fastest: f64,
    pub average: f64,
    pub slowest: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub p99_9: f64,
}

/// Counts and rates.
#[derive(Debug, Serialize)]
pub struct Stats {
    /// Responses and errors recorded.
    pub requests: u64,
    /// Responses with an expected status.
    pub successful: u64,
    /// Responses with another status, plus errors.
    pub failed: u64,
    /// Answered requests (any status) per second; errors without an answer are not counted.
    pub requests_per_second: f64,
    /// Attempts that got no answer at all (refused, reset, timed out) per second.
    pub errors_per_second: f64,
    /// Seconds measured (after warm-up).
    pub seconds: f64,
    /// Count per status code.
    pub statuses: BTreeMap<u16, u64>,
    /// Count per error kind.
    pub errors: BTreeMap<String, u64>,
    /// Latency of answered requests.
    pub latency_ms: Option<Latency>,
    /// Open loop: how late requests left against their schedule.
    pub send_lag_ms: Option<Latency>,
    /// Open loop: requests due before the end that were never sent, because every
    /// connection was still busy when the run ended (the rate was not kept).
    pub unsent: u64,
}

/// The whole report.
#[derive(Debug, Serialize)]
pub struct Report {
    pub url: String,
    pub method: String,
    pub connections: usize,
    /// `closed` or `open` (fixed rate).
    pub mode: &'static str,
    pub rate: Option<f64>,
    pub expect: String,
    #[serde(flatten)]
    pub stats: Stats,
}

/// Milliseconds at percentile `p` of `h`.
fn percentile_ms(h: &hdrhistogram::Histogram<u64>, p: f64) -> f64 {
    h.value_at_percentile(p) as f64 / 1e6
}

fn latency(h: &hdrhistogram::Histogram<u64>) -> Option<Latency> {
    (!h.is_empty()).then(|| Latency {
        fastest: h.min() as f64 / 1e6,
        average: h.mean() / 1e6,
        slowest: h.max() as f64 / 1e6,
        p50: percentile_ms(h, 50.0),
        p90: percentile_ms(h, 90.0),
        p99: percentile_ms(h, 99.0),
        p99_9: percentile_ms(h, 99.9),
    })
}

impl Stats {
    /// Summarizes a merged tally; `expect` empty means any 2xx.
    pub fn from_tally(t: &Tally, expect: &[u16], elapsed: Duration) -> Stats {
        let ok = |s: u16| {
            if expect.is_empty() {
                (200..300).contains(&s)
            } else {
                expect.contains(&s)
            }
        };
        let mut statuses = BTreeMap::new();
        let (mut successful, mut failed) = (0, 0);
        for (code, &n) in t.statuses.iter().enumerate() {
            if n == 0 {
                continue;
            }
            let code = u16::try_from(code).unwrap_or(0);
            statuses.insert(code, n);
            if ok(code) {
                successful += n;
            } else {
                failed += n;
            }
        }
        let mut errors = BTreeMap::new();
        for (kind, &n) in ErrorKind::ALL.iter().zip(&t.errors) {
            if n > 0 {
                let name = serde_json::to_value(kind)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_default();
                errors.insert(name, n);
                failed += n;
            }
        }
        let requests = successful + failed;
        let answered: u64 = statuses.values().sum();
        let seconds = elapsed.as_secs_f64();
        let per_second = |n: u64| {
            if seconds > 0.0 {
                n as f64 / seconds
            } else {
                0.0
            }
        };
        Stats {
            requests,
            successful,
            failed,
            requests_per_second: per_second(answered),
            errors_per_second: per_second(requests - answered),
            seconds,
            statuses,
            errors,
            latency_ms: latency(&t.latency),
            send_lag_ms: latency(&t.lag),
            unsent: t.unsent,
        }
    }
}

impl Report {
    /// Builds the report of a run.
    pub fn new(args: &BenchArgs, t: &Tally, elapsed: Duration) -> Report {
        let expect = if args.expect.is_empty() {
            "2xx".to_string()
        } else {
            args.expect
                .iter()
                .map(|c| c.to_string())
                .collect::<Vec<_>>()
                .join(",")
        };
        Report {
            url: args.url.clone(),
            method: args.method.to_ascii_uppercase(),
            connections: args.connections,
            mode: if args.rate.is_some() {
                "open"
            } else {
                "closed"
            },
            rate: args.rate,
            expect,
            stats: Stats::from_tally(t, &args.expect, elapsed),
        }
    }

    /// The report as text.
    pub fn text(&self) -> String {
        let s = &self.stats;
        let mut o = String::new();
        let mode = match self.rate {
            Some(r) => {
                format!("open loop at {r} req/s (latency from each request's intended send time)")
            }
            None => "closed loop".to_string(),
        };
        let _ = writeln!(
            o,
            "{} {}  {} connection(s), {mode}",
            self.method, self.url, self.connections
        );
        let _ = writeln!(o, "  Requests:      {} in {:.2} s", s.requests, s.seconds);
        let _ = writeln!(o, "  Requests/s:    {:.1} answered", s.requests_per_second);
        if s.errors_per_second > 0.0 {
            let _ = writeln!(o, "  Errors/s:      {:.1} (no answer)", s.errors_per_second);
        }
        if s.unsent > 0 {
            let _ = writeln!(
                o,
                "  Not sent:      {} due before the end, every connection busy: the rate was not kept",
                s.unsent
            );
        }
        // Only when nothing connected: a timeout or a reset means something is listening.
        if s.statuses.is_empty() && s.requests > 0 {
            if s.errors.keys().all(|k| k == "connect") {
                let _ = writeln!(
                    o,
                    "  No request was answered: is anything listening at the URL?"
                );
            } else if s.errors.keys().all(|k| k == "tls") {
                let _ = writeln!(
                    o,
                    "  No request was answered: the TLS handshake failed (a self-signed certificate needs -k; a plain port, http://)"
                );
            }
        }
        let _ = writeln!(
            o,
            "  Successful:    {} (expected: {})",
            s.successful, self.expect
        );
        let _ = writeln!(o, "  Failed:        {}", s.failed);
        let codes: Vec<String> = s
            .statuses
            .iter()
            .map(|(c, n)| format!("{c}: {n}"))
            .collect();
        let _ = writeln!(
            o,
            "  Statuses:      {}",
            if codes.is_empty() {
                "none".into()
            } else {
                codes.join(", ")
            }
        );
        let errs: Vec<String> = s.errors.iter().map(|(k, n)| format!("{k}: {n}")).collect();
        let _ = writeln!(
            o,
            "  Errors:        {}",
            if errs.is_empty() {
                "none".into()
            } else {
                errs.join(", ")
            }
        );
        if let Some(l) = &s.latency_ms {
            let _ = writeln!(
                o,
                "  Latency (ms):  fastest {:.3}  average {:.3}  slowest {:.3}",
                l.fastest, l.average, l.slowest
            );
            let _ = writeln!(
                o,
                "                 p50 {:.3}  p90 {:.3}  p99 {:.3}  p99.9 {:.3}",
                l.p50, l.p90, l.p99, l.p99_9
            );
        }
        if let Some(l) = &s.send_lag_ms {
            let _ = writeln!(
                o,
                "  Send lag (ms): p50 {:.3}  p99 {:.3}  slowest {:.3}",
                l.p50, l.p99, l.slowest
            );
        }
        o
    }
}
