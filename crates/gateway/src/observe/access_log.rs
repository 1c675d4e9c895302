//! The access log: one JSON object per line per request, written by a thread of its own.
//!
//! The request path only fills a [`Record`] and pushes it onto a bounded queue; the writer
//! takes the queue every 50 ms, formats and writes. When the queue is full, the line is
//! dropped and counted (`tollgate_access_log_dropped_total`): a slow disk never slows
//! requests. A line is
//! queued when the response body has been sent (or abandoned), so it carries the bytes
//! sent and the whole duration. `SIGUSR1` reopens the file, for logrotate.

use crate::observe::metrics::Metrics;
use crate::response::Body;
use bytes::Bytes;
use http::{HeaderValue, Method, Uri};
use http_body::{Body as HttpBody, Frame, SizeHint};
use parking_lot::Mutex;
use serde::Serialize;
use std::io::Write;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime};
use tollgate_config::{AccessLogConfig, LogTarget};

/// What one request did, as the access log writes it.
#[derive(Debug)]
pub struct Record {
    /// When the request arrived (wall clock, nanoseconds since the epoch).
    pub wall_ns: u64,
    /// `X-Request-Id`.
    pub request_id: HeaderValue,
    /// The client's address.
    pub client: HeaderValue,
    /// Method.
    pub method: Method,
    /// The target as the client sent it; credentials are removed when written.
    pub uri: Uri,
    /// Query parameters that carry keys, removed from the logged target.
    pub redact: Arc<[String]>,
    /// The route taken.
    pub route: Option<Arc<str>>,
    /// The authenticated consumer.
    pub consumer: Option<Arc<str>>,
    /// Response status.
    pub status: u16,
    /// Request body bytes declared by `Content-Length` (none when chunked).
    pub bytes_in: Option<u64>,
    /// Response body bytes sent.
    pub bytes_out: u64,
    /// From the request head to the end of the response body.
    pub duration: Duration,
    /// Time waiting for the upstream's response head.
    pub upstream_ns: Option<u64>,
    /// The upstream target that answered.
    pub target: Option<Arc<str>>,
    /// Why the gateway answered itself.
    pub refusal: Option<&'static str>,
    /// The limit that refused.
    pub limit: Option<Arc<str>>,
    /// `Cache-Status`, on routes with a cache.
    pub cache: Option<HeaderValue>,
}

/// What requests hand to the writer, and what the writer is asked to do.
#[derive(Default)]
struct Shared {
    /// Lines waiting for the writer. Requests push under the lock; the writer takes the
    /// whole batch at once, so each side holds it for a moment.
    queue: Mutex<Vec<Record>>,
    /// `SIGUSR1`: reopen the file.
    reopen: AtomicBool,
    /// Callers waiting until everything queued before them is written.
    syncs: Mutex<Vec<std::sync::mpsc::Sender<()>>>,
    /// The handle is gone: write what is left and stop.
    closed: AtomicBool,
}

/// The handle requests log through.
pub struct AccessLog {
    shared: Arc<Shared>,
    writer: Option<std::thread::Thread>,
    buffer: usize,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for AccessLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AccessLog").finish_non_exhaustive()
    }
}

/// How often the writer takes the queued lines when nobody hurries it. Waking it for
/// every line would cost a context switch per request.
const BATCH_EVERY: Duration = Duration::from_millis(50);

impl AccessLog {
    /// Starts the writer thread for `cfg`. A file that cannot be opened is reported (once)
    /// and its lines are dropped and counted until a reopen succeeds.
    pub fn start(cfg: &AccessLogConfig, metrics: Arc<Metrics>) -> Arc<AccessLog> {
        let shared = Arc::new(Shared::default());
        let target = cfg.target.clone();
        let m = metrics.clone();
        let sh = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("access-log".into())
            .spawn(move || Writer::new(target, m).run(&sh));
        let writer = match spawned {
            Ok(h) => Some(h.thread().clone()),
            Err(e) => {
                tracing::error!("cannot start the access log writer: {e}; lines will be dropped");
                None
            }
        };
        Arc::new(AccessLog {
            shared,
            writer,
            buffer: cfg.buffer,
            metrics,
        })
    }

    fn wake(&self) {
        if let Some(w) = &self.writer {
            w.unpark();
        }
    }

    /// Queues a line; drops and counts it when the writer is `buffer` lines behind.
    pub fn log(&self, rec: Box<Record>) {
        let len = {
            let mut q = self.shared.queue.lock();
            if q.len() >= self.buffer || self.writer.is_none() {
                drop(q);
                self.metrics.log_dropped.inc();
                return;
            }
            // Moved out of its box here, so the box is freed by the thread that made it.
            q.push(*rec);
            q.len()
        };
        // Half full: do not wait for the next round.
        if len == self.buffer / 2 {
            self.wake();
        }
    }

    /// Waits (at most `wait`) until every line queued so far is written and flushed.
    /// Returns whether it was.
    pub fn sync(&self, wait: Duration) -> bool {
        let (tx, rx) = std::sync::mpsc::channel();
        self.shared.syncs.lock().push(tx);
        self.wake();
        rx.recv_timeout(wait).is_ok()
    }

    /// Asks the writer to reopen its file (`SIGUSR1`).
    pub fn reopen(&self) {
        self.shared.reopen.store(true, Ordering::Release);
        self.wake();
    }
}

impl Drop for AccessLog {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::Release);
        self.wake();
    }
}

/// The writer thread's state.
struct Writer {
    target: LogTarget,
    out: Option<Box<dyn Write + Send>>,
    metrics: Arc<Metrics>,
    /// A failure was reported and nothing has succeeded since: stay quiet.
    failing: bool,
    line: Vec<u8>,
}

impl Writer {
    fn new(target: LogTarget, metrics: Arc<Metrics>) -> Self {
        let mut w = Writer {
            target,
            out: None,
            metrics,
            failing: false,
            line: Vec::with_capacity(512),
        };
        w.open();
        w
    }

    fn open(&mut self) {
        let out: std::io::Result<Box<dyn Write + Send>> = match &self.target {
            LogTarget::Stdout => Ok(Box::new(std::io::BufWriter::with_capacity(
                64 * 1024,
                std::io::stdout(),
            ))),
            LogTarget::File(p) => std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .map(|f| Box::new(std::io::BufWriter::with_capacity(64 * 1024, f)) as _),
        };
        match out {
            Ok(o) => {
                self.out = Some(o);
                if std::mem::take(&mut self.failing) {
                    tracing::info!(path = %self.path(), "access log writable again");
                }
            }
            Err(e) => {
                self.out = None;
                self.failed(&e);
            }
        }
    }

    fn path(&self) -> String {
        match &self.target {
            LogTarget::Stdout => "stdout".into(),
            LogTarget::File(p) => p.display().to_string(),
        }
    }

    fn failed(&mut self, e: &std::io::Error) {
        self.metrics.log_errors.inc();
        if !self.failing {
            self.failing = true;
            tracing::error!(path = %self.path(), "access log cannot be written: {e}; lines are dropped (counted in tollgate_access_log_dropped_total) until it can");
        }
    }

    fn run(mut self, shared: &Shared) {
        let mut batch: Vec<Record> = Vec::new();
        loop {
            // Take the waiting callers first: everything queued before they asked is in
            // the batch taken next.
            let syncs = std::mem::take(&mut *shared.syncs.lock());
            let reopen = shared.reopen.swap(false, Ordering::AcqRel);
            std::mem::swap(&mut batch, &mut *shared.queue.lock());
            for rec in batch.drain(..) {
                self.write(&rec);
            }
            self.flush();
            // Lines queued before the reopen was asked for go to the old file, as nginx
            // does with its buffers: logrotate moved it, and compresses it later.
            if reopen && matches!(self.target, LogTarget::File(_)) {
                self.open();
                tracing::info!(path = %self.path(), "access log reopened");
            }
            for s in syncs {
                let _ = s.send(());
            }
            if shared.closed.load(Ordering::Acquire) && shared.queue.lock().is_empty() {
                return;
            }
            std::thread::park_timeout(BATCH_EVERY);
        }
    }

    fn flush(&mut self) {
        if let Some(o) = self.out.as_mut() {
            if let Err(e) = o.flush() {
                self.failed(&e);
            }
        }
    }

    fn write(&mut self, rec: &Record) {
        self.line.clear();
        write_line(rec, &mut self.line);
        let Some(o) = self.out.as_mut() else {
            self.metrics.log_dropped.inc();
            return;
        };
        match o.write_all(&self.line) {
            Ok(()) => {
                self.metrics.log_lines.inc();
                if self.failing {
                    self.failing = false;
                    tracing::info!(path = %self.path(), "access log writable again");
                }
            }
            Err(e) => {
                self.metrics.log_dropped.inc();
                self.failed(&e);
            }
        }
    }
}

#[derive(Serialize)]
struct Line<'a> {
    time: String,
    request_id: &'a str,
    client: &'a str,
    method: &'a str,
    path: &'a str,
    route: Option<&'a str>,
    consumer: Option<&'a str>,
    status: u16,
    bytes_in: Option<u64>,
    bytes_out: u64,
    duration_ms: f64,
    upstream_ms: Option<f64>,
    upstream_target: Option<&'a str>,
    refusal: Option<&'a str>,
    limit: Option<&'a str>,
    cache: Option<&'a str>,
}

/// The logged target: path and query, without any parameter that carries a key.
pub fn logged_target(uri: &Uri, redact: &[String]) -> String {
    let path = uri.path();
    match uri.query() {
        None => path.to_string(),
        Some(q) => crate::policy::auth::without_credentials(path, q, redact),
    }
}

fn text(v: &HeaderValue) -> &str {
    std::str::from_utf8(v.as_bytes()).unwrap_or("")
}

fn ms(ns: u64) -> f64 {
    (ns as f64 / 1_000.0).round() / 1_000.0
}

fn write_line(rec: &Record, out: &mut Vec<u8>) {
    let time = SystemTime::UNIX_EPOCH + Duration::from_nanos(rec.wall_ns);
    let target = logged_target(&rec.uri, &rec.redact);
    let line = Line {
        time: humantime::format_rfc3339_millis(time).to_string(),
        request_id: text(&rec.request_id),
        client: text(&rec.client),
        method: rec.method.as_str(),
        path: &target,
        route: rec.route.as_deref(),
        consumer: rec.consumer.as_deref(),
        status: rec.status,
        bytes_in: rec.bytes_in,
        bytes_out: rec.bytes_out,
        duration_ms: ms(u64::try_from(rec.duration.as_nanos()).unwrap_or(u64::MAX)),
        upstream_ms: rec.upstream_ns.map(ms),
        upstream_target: rec.target.as_deref(),
        refusal: rec.refusal,
        limit: rec.limit.as_deref(),
        cache: rec.cache.as_ref().map(text),
    };
    if serde_json::to_writer(&mut *out, &line).is_ok() {
        out.push(b'\n');
    }
}

/// A response body that queues its request's access log line once it has been sent (or
/// dropped unfinished), counting the bytes on the way. Without a record it only passes
/// frames through.
pub struct Logged {
    inner: Body,
    pending: Option<(Box<Record>, Instant, Arc<AccessLog>)>,
}

impl Logged {
    /// `body`, logging `rec` at its end when given.
    pub fn new(inner: Body, pending: Option<(Box<Record>, Instant, Arc<AccessLog>)>) -> Self {
        Logged { inner, pending }
    }

    fn finish(&mut self) {
        if let Some((mut rec, start, log)) = self.pending.take() {
            rec.duration = start.elapsed();
            log.log(rec);
        }
    }
}

impl Drop for Logged {
    fn drop(&mut self) {
        self.finish();
    }
}

impl HttpBody for Logged {
    type Data = Bytes;
    type Error = <Body as HttpBody>::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        if this.pending.is_some() {
            match &polled {
                Poll::Ready(Some(Ok(f))) => {
                    if let (Some(d), Some((rec, _, _))) = (f.data_ref(), this.pending.as_mut()) {
                        rec.bytes_out += d.len() as u64;
                    }
                    if this.inner.is_end_stream() {
                        this.finish();
                    }
                }
                Poll::Ready(_) => this.finish(),
                Poll::Pending => {}
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
