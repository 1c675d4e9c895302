//! The queue requests push their records onto, and the thread that writes them out.

use super::json::{write_line, Clock};
use crate::observe::metrics::Metrics;
use crate::observe::record::Record;
use parking_lot::Mutex;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};
use tollgate_config::{AccessLogConfig, LogTarget};

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

/// How long a file that could not be opened waits before lines try it again.
const RETRY_OPEN: Duration = Duration::from_secs(1);

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
    /// When a file that could not be opened is tried again ([`RETRY_OPEN`] apart).
    retry_at: Option<Instant>,
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
            retry_at: None,
            buf: Vec::with_capacity(WRITE_AT + 4096),
            lines: 0,
            clock: Clock::default(),
        };
        w.open();
        w
    }

    fn open(&mut self) {
        if let Err(e) = self.try_open() {
            self.failed(&e);
        }
    }

    /// Opens the target; on failure the writer has no file until the retry, which is set.
    fn try_open(&mut self) -> std::io::Result<()> {
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
                self.retry_at = None;
                if std::mem::take(&mut self.failing) {
                    tracing::info!(path = %self.path(), "access log writable again");
                }
                Ok(())
            }
            Err(e) => {
                self.out = None;
                self.retry_at = Some(Instant::now() + RETRY_OPEN);
                Err(e)
            }
        }
    }

    /// Opens the file again if it could not be opened and its retry is due, so that a
    /// directory made later, or permissions mended, bring the log back by themselves. A
    /// retry that fails is the failure already reported and counted: it stays quiet.
    fn retry_open(&mut self) {
        if self.out.is_none() && self.retry_at.is_some_and(|at| Instant::now() >= at) {
            let _ = self.try_open();
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
            if !batch.is_empty() {
                self.retry_open();
            }
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
