//! The exporting task: takes queued records, writes their spans ([`super::otlp`]) and
//! sends them to the collector in batches, over gRPC (tonic) or protobuf over HTTP
//! (hyper), one export at a time, each bounded by the configured timeout.

use super::otlp::{self, Batch};
use crate::observe::metrics::Metrics;
use crate::observe::record::Record;
use bytes::Bytes;
use http::{HeaderName, HeaderValue, Uri};
use http_body_util::{BodyExt, Full};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
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

/// The most bytes of spans in one export request.
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

/// Finished requests waiting for their spans to be made and sent. Requests push under
/// the lock and the exporter takes everything at once, so each holds it for a moment; the
/// exporter is woken only when a batch is full (or a flush is asked): waking a task per
/// span would cost more than the span.
pub(super) struct Queue {
    held: Mutex<Vec<Record>>,
    cap: usize,
    batch: usize,
    /// Wakes the exporter: a full batch, a flush, the end.
    pub(super) wake: Notify,
    /// Callers waiting until what was queued before them is exported or given up.
    pub(super) flushes: Mutex<Vec<oneshot::Sender<()>>>,
    /// The handle is gone: export what is left and stop.
    pub(super) closed: AtomicBool,
}

impl Queue {
    pub(super) fn new(cap: usize, batch: usize) -> Self {
        Queue {
            held: Mutex::new(Vec::new()),
            cap,
            batch,
            wake: Notify::new(),
            flushes: Mutex::new(Vec::new()),
            closed: AtomicBool::new(false),
        }
    }

    /// Queues `rec`; false when `cap` records already wait.
    pub(super) fn push(&self, rec: Box<Record>) -> bool {
        let len = {
            let mut q = self.held.lock();
            if q.len() >= self.cap {
                return false;
            }
            // Moved out of its box here, so the box is freed by the thread that made it.
            q.push(*rec);
            q.len()
        };
        if len == self.batch {
            self.wake.notify_one();
        }
        true
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
    let mut taken: Vec<Record> = Vec::new();
    let mut batch = Batch::new();
    let mut last_warned = None;
    loop {
        tokio::select! {
            _ = queue.wake.notified() => {}
            _ = tick.tick() => {}
        }
        let closed = queue.closed.load(Ordering::Acquire);
        let waiting = std::mem::take(&mut *queue.flushes.lock());
        std::mem::swap(&mut taken, &mut *queue.held.lock());
        // One reading of both clocks per round: each span's wall-clock start is its
        // arrival measured back from now.
        let (now_wall, now) = (SystemTime::now(), Instant::now());
        let last = taken.len().saturating_sub(1);
        for (i, rec) in taken.iter().enumerate() {
            let start = now_wall
                .checked_sub(now.saturating_duration_since(rec.start))
                .unwrap_or(now_wall);
            batch.add(rec, start);
            // An export holds `batch_size` spans, and stays well under the 4 MiB a
            // collector's gRPC receiver takes by default.
            if batch.count == batching.size || batch.bytes() >= MAX_EXPORT_BYTES || i == last {
                let n = batch.count as u64;
                let body = batch.take(&resource, &scope);
                send(&exporter, body, n, &batching, &metrics, &mut last_warned).await;
            }
        }
        // Records are dropped here, in the exporter, not on a request's thread.
        taken.clear();
        for f in waiting {
            let _ = f.send(());
        }
        if closed {
            break;
        }
    }
}

/// Sends one export of `n` spans; counts what was exported or lost.
async fn send(
    exporter: &Exporter,
    body: Vec<u8>,
    n: u64,
    batching: &Batching,
    metrics: &Metrics,
    last_warned: &mut Option<Instant>,
) {
    // The clients have their own timeouts; this one bounds whatever they do beyond.
    let sent = tokio::time::timeout(batching.timeout, exporter.send(body)).await;
    let failed = match sent {
        Ok(Ok(())) => {
            metrics.trace_exported.inc_by(n);
            return;
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
}
