//! The queue of written spans ([`super::otlp`]) and the exporting task that sends them
//! to the collector in batches, over gRPC (tonic) or protobuf over HTTP
//! (hyper), one export at a time, each bounded by the configured timeout.

use super::otlp::{self, Batch, SpanWriter};
use crate::observe::metrics::Metrics;
use crate::observe::record::Record;
use bytes::Bytes;
use http::{HeaderName, HeaderValue, Uri};
use http_body_util::{BodyExt, Full};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use parking_lot::Mutex;
use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::{oneshot, Notify};
use tollgate_config::{OtlpProtocol, TracingConfig};

/// How spans are gathered into exports.
pub(super) struct Batching {
    /// Most spans in one export.
    pub size: usize,
    /// How often what waits is sent, when fewer than a batch wait.
    pub every: Duration,
    /// Longest wait for one export.
    pub timeout: Duration,
}

/// The most bytes of spans in one batch. Small enough that a batch is written and sent
/// while it is still in the cache: at `batch_size` 512 (about 300 KB of spans) writing
/// the batches evicted the request path's own data, and cost 3.7% more CPU per request
/// than batches of 64 spans (`docs/benchmarks.md`, "OpenTelemetry traces").
const BATCH_BYTES: usize = 64 << 10;

/// The most bytes of spans in one export request: batches that waited for the exporter (a
/// slow collector) go together, up to `batch_size` spans and this, under the 4 MiB a
/// collector's gRPC receiver takes by default.
const MAX_EXPORT_BYTES: usize = 2 << 20;

/// The gRPC method spans are exported with.
const GRPC_EXPORT: &str = "/opentelemetry.proto.collector.trace.v1.TraceService/Export";

/// Where and how export requests go.
// One per gateway: the size of its larger variant costs nothing.
#[allow(clippy::large_enum_variant)]
pub(super) enum Exporter {
    /// OTLP/gRPC through a tonic channel (HTTP/2, TLS for `https://`).
    Grpc {
        channel: tonic::transport::Channel,
        metadata: tonic::metadata::MetadataMap,
    },
    /// OTLP/HTTP: `POST` of the protobuf body.
    Http {
        client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
        uri: Uri,
        headers: Vec<(HeaderName, HeaderValue)>,
    },
}

/// The exporter for `cfg`. Must be made inside the runtime (the gRPC channel is made here,
/// and connects when first used).
pub(super) fn exporter(
    cfg: &TracingConfig,
) -> Result<Exporter, Box<dyn std::error::Error + Send + Sync>> {
    match cfg.protocol {
        OtlpProtocol::Grpc => {
            let mut metadata = tonic::metadata::MetadataMap::new();
            for (k, v) in &cfg.headers {
                let key = tonic::metadata::MetadataKey::from_bytes(k.as_bytes())?;
                metadata.insert(key, v.parse()?);
            }
            let mut endpoint = tonic::transport::Endpoint::from_shared(cfg.endpoint.clone())?
                .timeout(cfg.timeout)
                .connect_timeout(cfg.timeout);
            if cfg.endpoint.starts_with("https://") {
                endpoint = endpoint
                    .tls_config(tonic::transport::ClientTlsConfig::new().with_native_roots())?;
            }
            Ok(Exporter::Grpc {
                channel: endpoint.connect_lazy(),
                metadata,
            })
        }
        OtlpProtocol::Http => {
            let mut http = HttpConnector::new();
            http.set_nodelay(true);
            http.set_connect_timeout(Some(cfg.timeout));
            let client = crate::https_link::client(http)?;
            let mut headers = Vec::with_capacity(cfg.headers.len());
            for (k, v) in &cfg.headers {
                headers.push((
                    HeaderName::from_bytes(k.as_bytes())?,
                    HeaderValue::from_str(v)?,
                ));
            }
            Ok(Exporter::Http {
                client,
                uri: cfg.endpoint.parse()?,
                headers,
            })
        }
    }
}

impl Exporter {
    /// Sends one export request; `Err` says why it was not taken.
    async fn send(&self, body: Vec<u8>) -> Result<(), String> {
        match self {
            Exporter::Grpc { channel, metadata } => {
                let mut grpc = tonic::client::Grpc::new(channel.clone());
                grpc.ready()
                    .await
                    .map_err(|e| format!("collector not ready: {e}"))?;
                let mut req = tonic::Request::new(Bytes::from(body));
                *req.metadata_mut() = metadata.clone();
                grpc.unary::<_, (), _>(req, http::uri::PathAndQuery::from_static(GRPC_EXPORT), Raw)
                    .await
                    .map(|_| ())
                    .map_err(|s| format!("{:?}: {}", s.code(), s.message()))
            }
            Exporter::Http {
                client,
                uri,
                headers,
            } => {
                let mut req = http::Request::post(uri.clone())
                    .header(http::header::CONTENT_TYPE, "application/x-protobuf")
                    .body(Full::new(Bytes::from(body)))
                    .map_err(|e| e.to_string())?;
                for (k, v) in headers {
                    req.headers_mut().insert(k.clone(), v.clone());
                }
                let resp = client.request(req).await.map_err(|e| e.to_string())?;
                let status = resp.status();
                // The answer is read (and dropped) so the connection can be reused, up to
                // 64 KiB: a collector's reply says little, and a larger one is not waited for.
                let mut body = resp.into_body();
                let mut read = 0usize;
                while read < 64 << 10 {
                    match body.frame().await {
                        Some(Ok(f)) => read += f.data_ref().map_or(0, Bytes::len),
                        _ => break,
                    }
                }
                if status.is_success() {
                    Ok(())
                } else {
                    Err(format!("the collector answered {status}"))
                }
            }
        }
    }
}

/// gRPC's codec for bytes already encoded, and an answer that is not read (an
/// `ExportTraceServiceResponse` says only what was partially refused).
#[derive(Clone, Copy)]
struct Raw;

impl tonic::codec::Codec for Raw {
    type Encode = Bytes;
    type Decode = ();
    type Encoder = Raw;
    type Decoder = Raw;

    fn encoder(&mut self) -> Raw {
        Raw
    }

    fn decoder(&mut self) -> Raw {
        Raw
    }
}

impl tonic::codec::Encoder for Raw {
    type Item = Bytes;
    type Error = tonic::Status;

    fn encode(
        &mut self,
        item: Bytes,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        bytes::BufMut::put_slice(dst, &item);
        Ok(())
    }
}

impl tonic::codec::Decoder for Raw {
    type Item = ();
    type Error = tonic::Status;

    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<()>, tonic::Status> {
        let n = bytes::Buf::remaining(src);
        bytes::Buf::advance(src, n);
        Ok(Some(()))
    }
}

/// Spans waiting to be exported, already written. A request writes its span on its own
/// thread when its answer is done (its record still in the cache, outside the lock) and
/// adds the bytes under the lock; the exporter takes whole batches. The exporter is woken
/// only when a batch is full (or a flush is asked): waking a task per span would cost
/// more than the span.
pub(super) struct Queue {
    held: Mutex<Held>,
    /// Spans held, read without the lock to refuse early when full.
    waiting: AtomicUsize,
    cap: usize,
    batch: usize,
    /// Wakes the exporter: a full batch, a flush, the end.
    pub(super) wake: Notify,
    /// Callers waiting until what was queued before them is exported or given up.
    pub(super) flushes: Mutex<Vec<oneshot::Sender<()>>>,
    /// The handle is gone: export what is left and stop.
    pub(super) closed: AtomicBool,
}

/// What the queue holds.
struct Held {
    /// The batch spans are added to.
    filling: Batch,
    /// Full batches, oldest first.
    full: Vec<Batch>,
    /// Emptied batches, to be filled again (their buffers kept).
    spare: Vec<Batch>,
    /// Spans in `filling` and `full`.
    spans: usize,
}

/// Emptied batches kept for reuse.
const SPARE: usize = 4;

impl Held {
    /// Puts the batch being filled with the full ones, and starts another, with room for
    /// `room` bytes (it grows, up to [`BATCH_BYTES`], when its spans need more).
    fn hand_over(&mut self, room: usize) {
        let next = self.spare.pop().unwrap_or_else(|| Batch::new(room));
        let done = std::mem::replace(&mut self.filling, next);
        self.full.push(done);
    }
}

/// The room a new batch of `batch` spans starts with: most spans are under 1 KiB.
fn room(batch: usize) -> usize {
    batch.saturating_mul(1 << 10).min(BATCH_BYTES)
}

thread_local! {
    /// Each thread's span writer.
    static WRITER: RefCell<SpanWriter> = RefCell::new(SpanWriter::new());
}

impl Queue {
    pub(super) fn new(cap: usize, batch: usize) -> Self {
        Queue {
            held: Mutex::new(Held {
                filling: Batch::new(room(batch)),
                full: Vec::new(),
                spare: Vec::new(),
                spans: 0,
            }),
            waiting: AtomicUsize::new(0),
            cap,
            batch,
            wake: Notify::new(),
            flushes: Mutex::new(Vec::new()),
            closed: AtomicBool::new(false),
        }
    }

    /// Writes and queues `rec`'s span; false when `cap` spans already wait.
    pub(super) fn push(&self, rec: &Record) -> bool {
        if self.waiting.load(Ordering::Relaxed) >= self.cap {
            return false;
        }
        // `None` when the thread's writer is gone (a thread ending) or in use: dropped.
        let pushed = WRITER.try_with(|w| {
            let mut w = w.try_borrow_mut().ok()?;
            let span = w.write(rec, SystemTime::now());
            let mut held = self.held.lock();
            if held.spans >= self.cap {
                return None;
            }
            // A batch is handed over before the span that would take it past its bytes,
            // and when it has `batch` spans.
            let mut full =
                held.filling.count > 0 && held.filling.bytes() + span.len() + 4 > BATCH_BYTES;
            if full {
                held.hand_over(room(self.batch));
            }
            held.filling.push(span);
            held.spans += 1;
            self.waiting.store(held.spans, Ordering::Relaxed);
            if held.filling.count >= self.batch {
                held.hand_over(room(self.batch));
                full = true;
            }
            Some(full)
        });
        let Ok(Some(full)) = pushed else {
            return false;
        };
        if full {
            self.wake.notify_one();
        }
        true
    }

    /// Every batch with spans in it, oldest first; the queue is empty after.
    fn take(&self) -> Vec<Batch> {
        let mut held = self.held.lock();
        if held.filling.count > 0 {
            held.hand_over(room(self.batch));
        }
        let out = std::mem::take(&mut held.full);
        held.spans = 0;
        self.waiting.store(0, Ordering::Relaxed);
        out
    }

    /// Keeps an emptied batch for reuse.
    fn give_back(&self, batch: Batch) {
        let mut held = self.held.lock();
        if held.spare.len() < SPARE {
            held.spare.push(batch);
        }
    }
}

/// Exports what is queued every `batching.every`, or at once when a batch is full or a
/// flush is asked, until the handle is gone; then what is left.
pub(super) async fn run(
    exporter: Exporter,
    queue: Arc<Queue>,
    batching: Batching,
    service_name: String,
    metrics: Arc<Metrics>,
) {
    let resource = otlp::resource(&service_name);
    let scope = otlp::scope();
    let mut tick = tokio::time::interval(batching.every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_warned = None;
    // After a failed export, until the next tick: a full batch does not wake another try
    // (against a dead collector each try is a connection refused or timed out).
    let mut failing = false;
    loop {
        let ticked = tokio::select! {
            _ = queue.wake.notified() => false,
            _ = tick.tick() => true,
        };
        let closed = queue.closed.load(Ordering::Acquire);
        let waiting = std::mem::take(&mut *queue.flushes.lock());
        if failing && !ticked && !closed && waiting.is_empty() {
            continue;
        }
        failing = false;
        let mut batches = queue.take();
        let mut from = 0;
        while from < batches.len() {
            // Batches that waited together go in one export, within its bounds.
            let (mut to, mut n, mut bytes) = (from, 0, 0);
            while let Some(b) = batches.get(to) {
                if to > from
                    && (n + b.count > batching.size || bytes + b.bytes() > MAX_EXPORT_BYTES)
                {
                    break;
                }
                n += b.count;
                bytes += b.bytes();
                to += 1;
            }
            let body = otlp::request(&mut batches[from..to], &resource, &scope);
            from = to;
            let sent = send(
                &exporter,
                body,
                n as u64,
                &batching,
                &metrics,
                &mut last_warned,
            )
            .await;
            failing |= !sent;
        }
        for batch in batches {
            queue.give_back(batch);
        }
        for f in waiting {
            let _ = f.send(());
        }
        if closed {
            break;
        }
    }
}

/// Sends one export of `n` spans; counts what was exported or lost. True when exported.
async fn send(
    exporter: &Exporter,
    body: Vec<u8>,
    n: u64,
    batching: &Batching,
    metrics: &Metrics,
    last_warned: &mut Option<Instant>,
) -> bool {
    // The clients have their own timeouts; this one bounds whatever they do beyond.
    let sent = tokio::time::timeout(batching.timeout, exporter.send(body)).await;
    let failed = match sent {
        Ok(Ok(())) => {
            metrics.trace_exported.inc_by(n);
            return true;
        }
        Ok(Err(e)) => e,
        Err(_) => "timed out".to_string(),
    };
    metrics.trace_dropped_failed.inc_by(n);
    // A dead collector fails every export: say so once, then once a minute.
    let now = Instant::now();
    if last_warned.is_none_or(|t| now.duration_since(t) >= Duration::from_secs(60)) {
        *last_warned = Some(now);
        tracing::warn!(
            "tracing: export of {n} spans failed: {failed} (dropped; counted in tollgate_trace_spans_dropped_total)"
        );
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observe::record::Names;
    use http::{HeaderValue, Method};
    use smallvec::SmallVec;
    use std::time::Instant;

    #[derive(Debug)]
    struct Snap;
    impl Names for Snap {
        fn consumer_name(&self, _: usize) -> &str {
            "c"
        }
        fn credential_params(&self) -> &[String] {
            &[]
        }
    }

    /// A record whose span is about `path` bytes long.
    fn record(path: usize) -> Record {
        let mut uri = SmallVec::from_slice(b"/");
        uri.resize(path, b'p');
        Record {
            start: Instant::now(),
            request_id: SmallVec::from_slice(b"id"),
            client: HeaderValue::from_static("10.0.0.7"),
            method: Method::GET,
            uri,
            snap: Arc::new(Snap),
            route: None,
            consumer: None,
            status: 200,
            bytes_in: None,
            bytes_out: 0,
            duration: Duration::from_millis(1),
            upstream_ns: None,
            target: None,
            refusal: None,
            limit: None,
            cache: None,
            trace: None,
            span_head: None,
            retries: 0,
        }
    }

    #[test]
    fn batches_hold_at_most_their_spans_and_bytes_and_the_queue_its_cap() {
        let q = Queue::new(300, 100);
        // Spans of about 1 KiB: 64 KiB holds some 60 of them, fewer than `batch`.
        for _ in 0..250 {
            assert!(q.push(&record(1000)));
        }
        let big = q.take();
        assert_eq!(big.iter().map(|b| b.count).sum::<usize>(), 250);
        assert!(big.len() >= 4, "{} batches", big.len());
        for b in &big {
            assert!(b.bytes() <= BATCH_BYTES, "{} bytes", b.bytes());
        }
        // Every batch but the last was handed over for its bytes, not its count.
        for b in &big[..big.len() - 1] {
            assert!(b.count > 50 && b.count < 100, "{} spans", b.count);
        }
        // Small spans: a batch is `batch` spans.
        for _ in 0..250 {
            assert!(q.push(&record(10)));
        }
        let mut small = q.take();
        let counts: Vec<usize> = small.iter().map(|b| b.count).collect();
        assert_eq!(counts, [100, 100, 50]);
        // Batches that waited together make one export request, in order.
        let body = otlp::request(&mut small[..2], &otlp::resource("svc"), &otlp::scope());
        let req = <opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest as prost::Message>::decode(body.as_slice())
            .expect("an export request");
        assert_eq!(req.resource_spans[0].scope_spans[0].spans.len(), 200);
        assert_eq!(
            (small[0].count, small[1].count, small[0].bytes()),
            (0, 0, 0)
        );
        // The cap counts what waits; taking empties the queue.
        for _ in 0..300 {
            assert!(q.push(&record(10)));
        }
        assert!(!q.push(&record(10)));
        assert_eq!(q.take().iter().map(|b| b.count).sum::<usize>(), 300);
        assert!(q.push(&record(10)));
    }
}
