//! `tollgate bench`: a load generator whose statistics can be defended.
//!
//! Closed loop: C connections, each sending its next request as soon as the last answer
//! is in. Open loop (`--rate`): request i is due at start + i/rate, whatever happened to
//! earlier ones, and its latency is measured from that intended time, so a stall shows as
//! latency instead of being hidden by sending less (coordinated omission). A pacer thread
//! releases requests on schedule with `nanosleep` (tokio's timer has 1 ms granularity, which
//! would itself add up to 1 ms to every measured latency); how late each request actually
//! left is reported as "send lag". Latencies go into HDR histograms (per connection, merged
//! at the end).

#![forbid(unsafe_code)]

mod args;
mod client;
mod report;
mod tally;
mod tls;

pub use args::BenchArgs;

use client::{Conn, ErrorKind};
use report::Report;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tally::Tally;

/// What every connection needs to know.
struct Plan {
    addr: SocketAddr,
    /// For `https://`.
    tls: Option<client::Tls>,
    request: Vec<u8>,
    head_request: bool,
    total: Option<u64>,
    tickets: AtomicU64,
    rate: Option<f64>,
    /// Open loop: due tickets from the pacer thread.
    due: Option<async_channel::Receiver<u64>>,
    start: Instant,
    record_from: Instant,
    end: Option<Instant>,
    timeout: Duration,
    stop: AtomicBool,
    done: AtomicU64,
}

fn build_request(args: &BenchArgs, uri: &http::Uri, body: &[u8]) -> Result<Vec<u8>, String> {
    let method = args.method.to_ascii_uppercase();
    let host = uri
        .authority()
        .map(|a| a.as_str())
        .ok_or("the URL needs a host")?;
    let pq = uri.path_and_query().map_or("/", |p| p.as_str());
    let mut r = format!("{method} {pq} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: tollgate-bench\r\n");
    for h in &args.headers {
        let (name, value) = h
            .split_once(':')
            .ok_or_else(|| format!("header {h:?} must look like 'Name: value'"))?;
        r.push_str(&format!("{}: {}\r\n", name.trim(), value.trim()));
    }
    if !body.is_empty() || matches!(method.as_str(), "POST" | "PUT" | "PATCH") {
        r.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    r.push_str("\r\n");
    let mut bytes = r.into_bytes();
    bytes.extend_from_slice(body);
    Ok(bytes)
}

/// `tollgate bench …`.
pub fn run(args: BenchArgs) -> ExitCode {
    match try_run(args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("tollgate bench: {e}");
            ExitCode::from(2)
        }
    }
}

fn try_run(args: BenchArgs) -> Result<ExitCode, String> {
    // `127.0.0.1:8080/test/` as well as `http://127.0.0.1:8080/test/`, as curl takes it.
    let url = if args.url.contains("://") {
        args.url.clone()
    } else {
        format!("http://{}", args.url)
    };
    let uri: http::Uri = url
        .parse()
        .map_err(|e| format!("bad URL {:?}: {e}", args.url))?;
    let https = match uri.scheme_str() {
        Some("http") => false,
        Some("https") => true,
        _ => return Err("only http:// and https:// URLs are supported".into()),
    };
    if args.connections == 0 {
        return Err("-c must be at least 1".into());
    }
    if let Some(r) = args.rate {
        if !(r > 0.0 && r.is_finite()) {
            return Err("--rate must be a positive number".into());
        }
    }
    let body = match &args.body {
        Some(p) => std::fs::read(p).map_err(|e| format!("cannot read {}: {e}", p.display()))?,
        None => Vec::new(),
    };
    let request = build_request(&args, &uri, &body)?;
    let host = uri.host().unwrap_or("127.0.0.1");
    let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
    let tls = https
        .then(|| tls::client(host, args.insecure))
        .transpose()?;

    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if let Some(t) = args.threads {
        rt.worker_threads(t.max(1));
    }
    let rt = rt
        .enable_all()
        .build()
        .map_err(|e| format!("runtime: {e}"))?;
    rt.block_on(async move {
        let addr = tokio::net::lookup_host((host, port))
            .await
            .map_err(|e| format!("cannot resolve {host}: {e}"))?
            .next()
            .ok_or_else(|| format!("{host} has no address"))?;
        let duration = match (args.requests, args.duration) {
            (Some(_), _) => None,
            (None, d) => Some(d.unwrap_or(Duration::from_secs(10))),
        };
        let warmup = args.warmup.unwrap_or_default();
        let start = Instant::now();
        let end = duration.map(|d| start + warmup + d);
        let due = args.rate.map(|rate| {
            let (tx, rx) = async_channel::unbounded();
            let total = args.requests;
            std::thread::spawn(move || pace(tx, start, rate, end, total));
            rx
        });
        let plan = Arc::new(Plan {
            addr,
            tls,
            head_request: args.method.eq_ignore_ascii_case("HEAD"),
            request,
            total: args.requests,
            tickets: AtomicU64::new(0),
            rate: args.rate,
            due,
            start,
            record_from: start + warmup,
            end,
            timeout: args.timeout,
            stop: AtomicBool::new(false),
            done: AtomicU64::new(0),
        });
        // On a terminal, one line redrawn; piped, a line a second (a log shows the run).
        let terminal = std::io::IsTerminal::is_terminal(&std::io::stderr());
        let progress = duration.is_none_or(|d| d > Duration::from_secs(3)) || !terminal;
        if !terminal {
            eprintln!(
                "tollgate bench: {url}, {} connection{}{}",
                args.connections,
                if args.connections == 1 { "" } else { "s" },
                args.rate
                    .map_or(String::new(), |r| format!(", {r} req/s open loop"))
            );
        }
        let progress_task = progress.then(|| tokio::spawn(show_progress(plan.clone(), terminal)));
        let mut tasks = Vec::with_capacity(args.connections);
        for _ in 0..args.connections {
            tasks.push(tokio::spawn(connection(plan.clone())));
        }
        let mut tally = Tally::new();
        for t in tasks {
            if let Ok(t) = t.await {
                tally.merge(&t);
            }
        }
        let elapsed = Instant::now().saturating_duration_since(plan.record_from);
        if let Some(p) = progress_task {
            p.abort();
            if terminal {
                eprint!("\r\x1b[2K");
            }
        }
        let report = Report::new(&args, &tally, elapsed);
        if args.json {
            println!(
                "{}",
                serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?
            );
        } else {
            print!("{}", report.text());
        }
        Ok(if report.stats.failed == 0 {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(1)
        })
    })
}

/// Shows the run's progress each second on stderr: one line redrawn on a terminal, a new
/// line each second otherwise.
async fn show_progress(plan: Arc<Plan>, terminal: bool) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.tick().await;
    let mut last = 0;
    loop {
        tick.tick().await;
        let done = plan.done.load(Ordering::Relaxed);
        let line = format!(
            "{:>6.1}s  {:>10} requests  {:>9} req/s",
            plan.start.elapsed().as_secs_f64(),
            done,
            done - last
        );
        if terminal {
            eprint!("\r\x1b[2K{line}");
        } else {
            eprintln!("{line}");
        }
        last = done;
    }
}

/// How late past the run's end a due ticket must be taken to count as not sent.
const UNSENT_AFTER: Duration = Duration::from_millis(1);

/// The open-loop pacer: releases ticket i at start + i/rate, until the end or the count.
/// Tickets due while every connection is busy wait in the channel, and their latency
/// includes that wait.
fn pace(
    tx: async_channel::Sender<u64>,
    start: Instant,
    rate: f64,
    end: Option<Instant>,
    total: Option<u64>,
) {
    let mut ticket = 0u64;
    loop {
        if total.is_some_and(|n| ticket >= n) {
            return;
        }
        let at = start + Duration::from_secs_f64(ticket as f64 / rate);
        if end.is_some_and(|e| at >= e) {
            return;
        }
        let now = Instant::now();
        if at > now {
            std::thread::sleep(at - now);
        }
        if tx.send_blocking(ticket).is_err() {
            return;
        }
        ticket += 1;
    }
}

/// One connection's loop: take a ticket, wait for its time (open loop), exchange, record.
async fn connection(plan: Arc<Plan>) -> Tally {
    let mut t = Tally::new();
    let mut conn: Option<Conn> = None;
    loop {
        if plan.stop.load(Ordering::Relaxed) {
            break;
        }
        let intended = match (&plan.due, plan.rate) {
            (Some(due), Some(r)) => match due.recv().await {
                Ok(ticket) => {
                    let at = plan.start + Duration::from_secs_f64(ticket as f64 / r);
                    // The run is over: what is still queued was due, but no connection was
                    // free to send it. Counted, not sent (as wrk2 stops at its duration).
                    // A ticket taken only just late (the pacer's sleep overshoots by tens
                    // of microseconds) is sent: the rate was kept.
                    let now = Instant::now();
                    if plan.end.is_some_and(|e| now >= e)
                        && now.saturating_duration_since(at) > UNSENT_AFTER
                    {
                        if at >= plan.record_from {
                            t.unsent += 1;
                        }
                        continue;
                    }
                    at
                }
                Err(_) => break,
            },
            _ => {
                let ticket = plan.tickets.fetch_add(1, Ordering::Relaxed);
                if plan.total.is_some_and(|n| ticket >= n) {
                    break;
                }
                if plan.end.is_some_and(|e| Instant::now() >= e) {
                    break;
                }
                Instant::now()
            }
        };
        let sent = Instant::now();
        let result = tokio::time::timeout(plan.timeout, async {
            if conn.is_none() {
                conn = Some(Conn::open(plan.addr, plan.tls.as_ref()).await?);
            }
            match conn.as_mut() {
                Some(c) => c.exchange(&plan.request, plan.head_request).await,
                None => Err(ErrorKind::Connect),
            }
        })
        .await
        .unwrap_or(Err(ErrorKind::Timeout));
        let done = Instant::now();
        let record = intended >= plan.record_from;
        match result {
            Ok((status, keep_alive)) => {
                if record {
                    let ns =
                        u64::try_from(done.duration_since(intended).as_nanos()).unwrap_or(u64::MAX);
                    t.latency.saturating_record(ns.max(1));
                    if plan.rate.is_some() {
                        let lag =
                            u64::try_from(sent.saturating_duration_since(intended).as_nanos())
                                .unwrap_or(u64::MAX);
                        t.lag.saturating_record(lag.max(1));
                    }
                    if let Some(s) = t.statuses.get_mut(usize::from(status)) {
                        *s += 1;
                    }
                }
                if !keep_alive {
                    conn = None;
                }
            }
            Err(kind) => {
                if record {
                    if let Some(i) = ErrorKind::ALL.iter().position(|k| *k == kind) {
                        t.errors[i] += 1;
                    }
                }
                conn = None;
                if matches!(kind, ErrorKind::Connect | ErrorKind::Tls) {
                    // Do not spin on a refused port; the next ticket retries.
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
        plan.done.fetch_add(1, Ordering::Relaxed);
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;
    use report::Stats;

    #[test]
    fn builds_requests() {
        let args = BenchArgs {
            url: "http://127.0.0.1:8080/test/?apikey=t1".into(),
            requests: Some(1),
            duration: None,
            connections: 1,
            rate: None,
            method: "post".into(),
            headers: vec!["X-A: 1".into()],
            body: None,
            expect: vec![],
            warmup: None,
            timeout: Duration::from_secs(1),
            threads: None,
            json: false,
            insecure: false,
        };
        let uri: http::Uri = args.url.parse().expect("uri");
        let r = build_request(&args, &uri, b"hi").expect("req");
        assert_eq!(
            String::from_utf8_lossy(&r),
            "POST /test/?apikey=t1 HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nUser-Agent: tollgate-bench\r\nX-A: 1\r\nContent-Length: 2\r\n\r\nhi"
        );
    }

    #[test]
    fn stats_are_merged() {
        let mut a = Tally::new();
        let mut b = Tally::new();
        a.latency.saturating_record(1_000);
        b.latency.saturating_record(3_000);
        a.statuses[200] = 1;
        b.statuses[429] = 1;
        a.merge(&b);
        let s = Stats::from_tally(&a, &[], Duration::from_secs(1));
        assert_eq!((s.successful, s.failed), (1, 1));
        assert_eq!(s.requests, 2);
    }
}
