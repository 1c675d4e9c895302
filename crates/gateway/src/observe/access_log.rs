//! The access log: one JSON object per line per request, written by a thread of its own.
//!
//! The request path only fills a [`Record`] and pushes it onto a bounded queue; the writer
//! takes the queue every 50 ms, formats and writes. When the queue is full, the line is
//! dropped and counted (`tollgate_access_log_dropped_total`): a slow disk never slows
//! requests. A line is
//! queued when the response body has been sent (or abandoned), so it carries the bytes
//! sent and the whole duration. `SIGUSR1` reopens the file, for logrotate.

use crate::observe::metrics::Metrics;
use bytes::Bytes;
use http::{HeaderValue, Method};
use http_body::{Body as HttpBody, Frame, SizeHint};
use parking_lot::Mutex;
use smallvec::SmallVec;
use std::io::Write;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime};
use tollgate_config::{AccessLogConfig, LogTarget};

/// What the access log asks of the snapshot a request was served on: who its consumers
/// are and which query parameters carry keys (removed from the logged target).
pub trait Names: Send + Sync + std::fmt::Debug {
    /// The name of the consumer at `index`.
    fn consumer_name(&self, index: usize) -> &str;
    /// Query parameter names that carry credentials.
    fn credential_params(&self) -> &[String];
}

/// What one request did, as the access log writes it.
#[derive(Debug)]
pub struct Record {
    /// When the request arrived. The writer turns it into wall-clock time against one
    /// reading of both clocks per batch: no wall-clock read per request.
    pub start: Instant,
    /// `X-Request-Id`.
    /// A copy held inline (a generated id is 32 bytes): a clone of the header would be
    /// freed by the writer, and a client's id would hold the connection's read buffer.
    pub request_id: SmallVec<[u8; 32]>,
    /// The client's address.
    pub client: HeaderValue,
    /// Method.
    pub method: Method,
    /// Path and query as the client sent them; credentials are removed when written. A
    /// copy: holding the request's own bytes would keep the connection's read buffer from
    /// being reused.
    pub uri: SmallVec<[u8; 96]>,
    /// The snapshot the request was served on: it names the consumer and the query
    /// parameters that carry keys (removed from the logged target). The request's own
    /// reference, moved here when it is done, so it costs nothing.
    pub snap: Arc<dyn Names>,
    /// The route taken.
    pub route: Option<Arc<str>>,
    /// The authenticated consumer, by index in `snap`.
    pub consumer: Option<usize>,
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
    /// Lines formatted and not yet written, and how many.
    buf: Vec<u8>,
    lines: u64,
    clock: Clock,
}

/// The writer writes its buffer once it holds this much, and at the end of every batch.
const WRITE_AT: usize = 64 * 1024;

impl Writer {
    fn new(target: LogTarget, metrics: Arc<Metrics>) -> Self {
        let mut w = Writer {
            target,
            out: None,
            metrics,
            failing: false,
            buf: Vec::with_capacity(WRITE_AT + 4096),
            lines: 0,
            clock: Clock::default(),
        };
        w.open();
        w
    }

    fn open(&mut self) {
        let out: std::io::Result<Box<dyn Write + Send>> = match &self.target {
            // Lines are written in batches from the writer's own buffer: no second buffer.
            LogTarget::Stdout => Ok(Box::new(std::io::stdout())),
            LogTarget::File(p) => std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .map(|f| Box::new(f) as _),
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
            let (wall, mono) = (SystemTime::now(), Instant::now());
            let wall_ns = wall
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
            for rec in batch.drain(..) {
                let ago = u64::try_from(mono.saturating_duration_since(rec.start).as_nanos());
                let arrived = wall_ns.saturating_sub(ago.unwrap_or(u64::MAX));
                write_line(&rec, arrived, &mut self.clock, &mut self.buf);
                self.lines += 1;
                if self.buf.len() >= WRITE_AT {
                    self.write_out();
                }
            }
            self.write_out();
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

    /// Writes the formatted lines and counts them as written or dropped.
    fn write_out(&mut self) {
        let lines = std::mem::take(&mut self.lines);
        if lines == 0 {
            return;
        }
        let result = self.out.as_mut().map(|o| o.write_all(&self.buf));
        self.buf.clear();
        let Some(result) = result else {
            self.metrics.log_dropped.inc_by(lines);
            return;
        };
        match result {
            Ok(()) => {
                self.metrics.log_lines.inc_by(lines);
                if self.failing {
                    self.failing = false;
                    tracing::info!(path = %self.path(), "access log writable again");
                }
            }
            Err(e) => {
                self.metrics.log_dropped.inc_by(lines);
                self.failed(&e);
            }
        }
    }
}

fn text(v: &HeaderValue) -> &str {
    std::str::from_utf8(v.as_bytes()).unwrap_or("")
}

/// Writes JSON lines by hand: the writer's whole job, so it is worth not going through a
/// generic serializer (serde_json cost about 3,000 instructions a line in escaping alone).
/// Each member is written with its key, quotes and separator as one static piece.
struct Json<'a> {
    out: &'a mut Vec<u8>,
}

impl Json<'_> {
    /// A string member that may need escaping (`key` is `,"name":`).
    #[inline(always)]
    fn str(&mut self, key: &[u8], v: Option<&str>) {
        self.out.extend_from_slice(key);
        match v {
            Some(v) => escape(self.out, v),
            None => self.out.extend_from_slice(b"null"),
        }
    }

    /// A string member known to need no escaping: validated ids, addresses, names the
    /// config checked, the gateway's own words.
    #[inline(always)]
    fn plain(&mut self, key: &[u8], v: Option<&[u8]>) {
        self.out.extend_from_slice(key);
        match v {
            Some(v) => {
                self.out.push(b'"');
                self.out.extend_from_slice(v);
                self.out.push(b'"');
            }
            None => self.out.extend_from_slice(b"null"),
        }
    }

    /// The target without the parameters that carry keys (`redact`), written as it is
    /// cut: no copy of the cut target is made.
    fn target(&mut self, key: &[u8], target: &str, redact: &[String]) {
        self.out.extend_from_slice(key);
        self.out.push(b'"');
        match target.bytes().position(|b| b == b'?') {
            Some(i) if !redact.is_empty() => {
                escape_into(self.out, &target[..i]);
                let out = &mut *self.out;
                crate::query::kept_pieces(&target[i + 1..], redact, |sep, piece| {
                    out.push(sep);
                    escape_into(out, piece);
                });
            }
            _ => escape_into(self.out, target),
        }
        self.out.push(b'"');
    }

    #[inline(always)]
    fn num(&mut self, key: &[u8], v: Option<u64>) {
        self.out.extend_from_slice(key);
        match v {
            Some(v) => self
                .out
                .extend_from_slice(itoa::Buffer::new().format(v).as_bytes()),
            None => self.out.extend_from_slice(b"null"),
        }
    }

    /// Nanoseconds as milliseconds with three decimals (whole microseconds).
    #[inline(always)]
    fn ms(&mut self, key: &[u8], ns: Option<u64>) {
        self.out.extend_from_slice(key);
        let Some(ns) = ns else {
            self.out.extend_from_slice(b"null");
            return;
        };
        let us = ns.saturating_add(500) / 1_000;
        self.out
            .extend_from_slice(itoa::Buffer::new().format(us / 1_000).as_bytes());
        let frac = us % 1_000;
        self.out.extend_from_slice(&[
            b'.',
            b'0' + u8::try_from(frac / 100).unwrap_or(0),
            b'0' + u8::try_from(frac / 10 % 10).unwrap_or(0),
            b'0' + u8::try_from(frac % 10).unwrap_or(0),
        ]);
    }
}

/// Whether a byte must be escaped in a JSON string.
fn needs_escape(c: u8) -> bool {
    c < 0x20 || c == b'"' || c == b'\\'
}

/// Whether any byte of `b` must be escaped, eight bytes at a time: a byte below 0x20, a
/// quote or a backslash (bytes of 0x80 and above are UTF-8 and pass).
fn any_needs_escape(b: &[u8]) -> bool {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    // A byte of `x` is below `n` (n <= 0x80): the classic exact "has less" test.
    let below = |x: u64, n: u64| x.wrapping_sub(ONES * n) & !x & HIGH;
    let mut chunks = b.chunks_exact(8);
    for c in &mut chunks {
        let mut w = [0u8; 8];
        w.copy_from_slice(c);
        let x = u64::from_le_bytes(w);
        if below(x, 0x20) | below(x ^ (ONES * 0x22), 1) | below(x ^ (ONES * 0x5c), 1) != 0 {
            return true;
        }
    }
    chunks.remainder().iter().any(|&c| needs_escape(c))
}

/// A JSON string: quoted, with `"`, `\\` and control characters escaped.
pub(crate) fn escape(out: &mut Vec<u8>, s: &str) {
    out.push(b'"');
    escape_into(out, s);
    out.push(b'"');
}

/// The inside of a JSON string: `s` with `"`, `\\` and control characters escaped.
fn escape_into(out: &mut Vec<u8>, s: &str) {
    let b = s.as_bytes();
    let plain = !any_needs_escape(b);
    if plain {
        out.extend_from_slice(b);
    } else {
        for &c in b {
            match c {
                b'"' => out.extend_from_slice(b"\\\""),
                b'\\' => out.extend_from_slice(b"\\\\"),
                b'\n' => out.extend_from_slice(b"\\n"),
                b'\r' => out.extend_from_slice(b"\\r"),
                b'\t' => out.extend_from_slice(b"\\t"),
                c if c < 0x20 => {
                    const HEX: &[u8; 16] = b"0123456789abcdef";
                    out.extend_from_slice(b"\\u00");
                    out.push(HEX[usize::from(c >> 4)]);
                    out.push(HEX[usize::from(c & 0xf)]);
                }
                c => out.push(c),
            }
        }
    }
}

/// The RFC 3339 time of a line, made once a second and completed with milliseconds.
#[derive(Default)]
struct Clock {
    second: u64,
    prefix: String,
}

impl Clock {
    fn write(&mut self, wall_ns: u64, out: &mut Vec<u8>) {
        let second = wall_ns / 1_000_000_000;
        if self.prefix.is_empty() || second != self.second {
            let t = SystemTime::UNIX_EPOCH + Duration::from_secs(second);
            // `2026-11-22T18:55:39Z` without its `Z`.
            let mut p = humantime::format_rfc3339_seconds(t).to_string();
            p.pop();
            self.prefix = p;
            self.second = second;
        }
        out.push(b'"');
        out.extend_from_slice(self.prefix.as_bytes());
        let ms = wall_ns / 1_000_000 % 1_000;
        out.extend_from_slice(&[
            b'.',
            b'0' + u8::try_from(ms / 100).unwrap_or(0),
            b'0' + u8::try_from(ms / 10 % 10).unwrap_or(0),
            b'0' + u8::try_from(ms % 10).unwrap_or(0),
            b'Z',
            b'"',
        ]);
    }
}

/// Writes `rec`'s line; it arrived at `arrived_ns` (wall clock, since the epoch).
fn write_line(rec: &Record, arrived_ns: u64, clock: &mut Clock, out: &mut Vec<u8>) {
    out.extend_from_slice(b"{\"time\":");
    clock.write(arrived_ns, out);
    let mut j = Json { out };
    // Ids are validated to need no escaping; addresses, methods, limit names and targets
    // cannot hold a quote or a backslash.
    j.plain(b",\"request_id\":", Some(&rec.request_id));
    j.plain(b",\"client\":", Some(rec.client.as_bytes()));
    j.plain(b",\"method\":", Some(rec.method.as_str().as_bytes()));
    // A copy of a `&str`: always UTF-8.
    let uri = std::str::from_utf8(&rec.uri).unwrap_or("");
    j.target(b",\"path\":", uri, rec.snap.credential_params());
    j.str(b",\"route\":", rec.route.as_deref());
    j.str(
        b",\"consumer\":",
        rec.consumer.map(|c| rec.snap.consumer_name(c)),
    );
    j.num(b",\"status\":", Some(u64::from(rec.status)));
    j.num(b",\"bytes_in\":", rec.bytes_in);
    j.num(b",\"bytes_out\":", Some(rec.bytes_out));
    j.ms(
        b",\"duration_ms\":",
        Some(u64::try_from(rec.duration.as_nanos()).unwrap_or(u64::MAX)),
    );
    j.ms(b",\"upstream_ms\":", rec.upstream_ns);
    j.plain(
        b",\"upstream_target\":",
        rec.target.as_deref().map(str::as_bytes),
    );
    j.plain(b",\"refusal\":", rec.refusal.map(str::as_bytes));
    j.plain(b",\"limit\":", rec.limit.as_deref().map(str::as_bytes));
    j.str(b",\"cache\":", rec.cache.as_ref().map(text));
    j.out.extend_from_slice(b"}\n");
}

/// A response body that queues its request's access log line once it has been sent (or
/// dropped unfinished), counting the bytes on the way. Without a record it only passes
/// frames through.
pub struct Logged<B> {
    inner: B,
    pending: Option<(Box<Record>, Arc<AccessLog>)>,
}

impl<B> Logged<B> {
    /// `body`, logging `rec` at its end when given.
    pub fn new(inner: B, pending: Option<(Box<Record>, Arc<AccessLog>)>) -> Self {
        Logged { inner, pending }
    }

    fn finish(&mut self) {
        if let Some((mut rec, log)) = self.pending.take() {
            rec.duration = rec.start.elapsed();
            log.log(rec);
        }
    }
}

impl<B> Drop for Logged<B> {
    fn drop(&mut self) {
        self.finish();
    }
}

impl<B: HttpBody<Data = Bytes> + Unpin> HttpBody for Logged<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        if this.pending.is_some() {
            match &polled {
                Poll::Ready(Some(Ok(f))) => {
                    if let (Some(d), Some((rec, _))) = (f.data_ref(), this.pending.as_mut()) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_word_test_for_escapes_agrees_with_the_byte_test() {
        let mut cases: Vec<Vec<u8>> = vec![Vec::new(), b"/plain/path?x=1&y=2".to_vec()];
        for bad in [0u8, 0x1f, b'"', b'\\', b'\n'] {
            for at in 0..20 {
                let mut v = b"abcdefghijklmnopqrst".to_vec();
                v[at] = bad;
                cases.push(v);
            }
        }
        // Bytes next to the limits, and UTF-8 (high bit set), never need escaping.
        cases.push(vec![
            0x20, 0x21, 0x23, 0x5b, 0x5d, 0x7f, 0x80, 0xff, 0xc3, 0xa9,
        ]);
        for c in &cases {
            assert_eq!(
                any_needs_escape(c),
                c.iter().any(|&b| needs_escape(b)),
                "{c:?}"
            );
        }
    }

    #[test]
    fn lines_are_json_with_escapes_and_fixed_decimals() {
        #[derive(Debug)]
        struct Snap;
        impl Names for Snap {
            fn consumer_name(&self, _: usize) -> &str {
                "c\"1"
            }
            fn credential_params(&self) -> &[String] {
                static NAMES: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
                NAMES.get_or_init(|| vec!["ApiKey".to_string()])
            }
        }
        let snap = Arc::new(Snap);
        let rec = Record {
            start: Instant::now(),
            request_id: SmallVec::from_slice(b"abc"),
            client: HeaderValue::from_static("10.0.0.7"),
            method: Method::GET,
            uri: SmallVec::from_slice(b"/p?x=1&apikey=s3cret;y=\""),
            snap,
            route: Some(Arc::from("r\"q")),
            consumer: Some(0),
            status: 200,
            bytes_in: None,
            bytes_out: 27,
            duration: Duration::from_nanos(1_234_567),
            upstream_ns: Some(5_000_400),
            target: None,
            refusal: None,
            limit: None,
            cache: None,
        };
        let mut out = Vec::new();
        write_line(
            &rec,
            1_795_375_742_123_456_789,
            &mut Clock::default(),
            &mut out,
        );
        let text = String::from_utf8(out).expect("utf8");
        assert!(text.ends_with('\n'));
        let v: serde_json::Value = serde_json::from_str(&text).expect("json");
        assert_eq!(v["time"], "2026-11-22T19:29:02.123Z");
        assert_eq!(v["path"], "/p?x=1;y=\"");
        assert_eq!(v["route"], "r\"q");
        assert_eq!(v["consumer"], "c\"1");
        assert_eq!(v["limit"], serde_json::Value::Null);
        assert_eq!(v["duration_ms"], 1.235);
        assert_eq!(v["upstream_ms"], 5.0);
        assert_eq!(v["bytes_in"], serde_json::Value::Null);
        assert!(text.contains("\"upstream_ms\":5.000,"), "{text}");
    }
}
