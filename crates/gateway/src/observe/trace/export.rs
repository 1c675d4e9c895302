//! The exporting task: takes queued records, makes their spans and sends them to the
//! collector in batches (OpenTelemetry's OTLP exporter, gRPC or HTTP), one export at a
//! time, each bounded by the configured timeout.

use crate::observe::metrics::Metrics;
use crate::observe::record::Record;
use opentelemetry::InstrumentationScope;
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig, WithTonicConfig};
use opentelemetry_sdk::trace::SpanExporter as _;
use opentelemetry_sdk::Resource;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::{mpsc, oneshot};
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

/// The OTLP exporter for `cfg`, with the gateway's resource (`service.name`). Must be
/// made inside the runtime (the gRPC channel is made here, and connects when first used).
pub(super) fn exporter(
    cfg: &TracingConfig,
) -> Result<opentelemetry_otlp::SpanExporter, Box<dyn std::error::Error + Send + Sync>> {
    let builder = opentelemetry_otlp::SpanExporter::builder();
    let mut exporter = match cfg.protocol {
        OtlpProtocol::Grpc => {
            let mut meta = tonic::metadata::MetadataMap::new();
            for (k, v) in &cfg.headers {
                let key = tonic::metadata::MetadataKey::from_bytes(k.as_bytes())?;
                meta.insert(key, v.parse()?);
            }
            let mut b = builder
                .with_tonic()
                .with_endpoint(cfg.endpoint.clone())
                .with_timeout(cfg.timeout)
                .with_metadata(meta);
            if cfg.endpoint.starts_with("https://") {
                b = b.with_tls_config(tonic::transport::ClientTlsConfig::new().with_native_roots());
            }
            b.build()?
        }
        OtlpProtocol::Http => {
            let headers: HashMap<String, String> = cfg.headers.iter().cloned().collect();
            let b = builder
                .with_http()
                .with_endpoint(cfg.endpoint.clone())
                .with_timeout(cfg.timeout)
                .with_headers(headers)
                .with_protocol(opentelemetry_otlp::Protocol::HttpBinary);
            if cfg.endpoint.starts_with("https://") {
                let tls = hyper_rustls::HttpsConnectorBuilder::new()
                    .with_provider_and_native_roots(Arc::new(
                        rustls::crypto::ring::default_provider(),
                    ))?
                    .https_only()
                    .enable_http1()
                    .build();
                b.with_http_client(opentelemetry_http::hyper::HyperClient::new(
                    tls,
                    cfg.timeout,
                    None,
                ))
                .build()?
            } else {
                b.with_http_client(
                    opentelemetry_http::hyper::HyperClient::with_default_connector(
                        cfg.timeout,
                        None,
                    ),
                )
                .build()?
            }
        }
    };
    exporter.set_resource(
        &Resource::builder_empty()
            .with_service_name(cfg.service_name.clone())
            .build(),
    );
    Ok(exporter)
}

/// Exports what arrives on `rx` until every handle is gone, then what is left. A flush
/// asked on `flushes` is answered once everything queued before it is exported or given up.
pub(super) async fn run(
    exporter: opentelemetry_otlp::SpanExporter,
    mut rx: mpsc::Receiver<Box<Record>>,
    mut flushes: mpsc::UnboundedReceiver<oneshot::Sender<()>>,
    batching: Batching,
    metrics: Arc<Metrics>,
) {
    let scope = InstrumentationScope::builder("tollgate")
        .with_version(env!("CARGO_PKG_VERSION"))
        .build();
    let mut held: Vec<Box<Record>> = Vec::with_capacity(batching.size);
    let mut tick = tokio::time::interval(batching.every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut open = true;
    let mut last_warned = None;
    while open {
        let mut waiting = Vec::new();
        let room = batching.size - held.len();
        tokio::select! {
            n = rx.recv_many(&mut held, room) => {
                open = n > 0;
                if open && held.len() < batching.size {
                    continue;
                }
            }
            _ = tick.tick() => {}
            Some(f) = flushes.recv() => {
                waiting.push(f);
                // Everything queued before the flush was asked, in batches.
                while let Ok(r) = rx.try_recv() {
                    held.push(r);
                    if held.len() == batching.size {
                        send(&exporter, &mut held, &scope, &batching, &metrics, &mut last_warned).await;
                    }
                }
            }
        }
        if !held.is_empty() {
            send(
                &exporter,
                &mut held,
                &scope,
                &batching,
                &metrics,
                &mut last_warned,
            )
            .await;
        }
        for f in waiting {
            let _ = f.send(());
        }
    }
    let _ = exporter.shutdown();
}

/// Sends `held` as one export and empties it; counts what was exported or lost.
// Boxes as they came off the queue (whose slots they keep small): moving each record out
// of its box would only copy it.
#[allow(clippy::vec_box)]
async fn send(
    exporter: &opentelemetry_otlp::SpanExporter,
    held: &mut Vec<Box<Record>>,
    scope: &InstrumentationScope,
    batching: &Batching,
    metrics: &Metrics,
    last_warned: &mut Option<Instant>,
) {
    // One reading of both clocks for the batch: each span's wall-clock start is its
    // arrival measured back from now.
    let (now_wall, now) = (SystemTime::now(), Instant::now());
    let spans: Vec<_> = held
        .drain(..)
        .map(|rec| {
            let start = now_wall
                .checked_sub(now.saturating_duration_since(rec.start))
                .unwrap_or(now_wall);
            super::span::span_of(&rec, start, scope)
        })
        .collect();
    let n = spans.len() as u64;
    // The exporter has its own timeout; this one bounds whatever it does beyond.
    let sent = tokio::time::timeout(
        batching.timeout + Duration::from_secs(1),
        exporter.export(spans),
    )
    .await;
    let failed = match sent {
        Ok(Ok(())) => {
            metrics.trace_exported.inc_by(n);
            return;
        }
        Ok(Err(e)) => e.to_string(),
        Err(_) => "timed out".to_string(),
    };
    metrics.trace_dropped_failed.inc_by(n);
    // A dead collector fails every export: say so once, then once a minute.
    let now = Instant::now();
    if last_warned.is_none_or(|t| now.duration_since(t) >= Duration::from_secs(60)) {
        *last_warned = Some(now);
        tracing::warn!("tracing: export of {n} spans failed: {failed} (dropped; counted in tollgate_trace_spans_dropped_total)");
    }
}
