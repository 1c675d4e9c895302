//! OpenTelemetry traces: one server span per request, exported over OTLP.
//!
//! On the request path a trace costs a sampling decision, two random ids and a
//! `traceparent` header for the upstream. A recorded span is the request's [`Record`],
//! pushed onto a bounded queue when the answer's body is done; a task turns queued records
//! into spans and exports them in batches. A full queue drops the span and counts it
//! (`tollgate_trace_spans_dropped_total{reason="queue_full"}`), a failed export counts
//! its spans under `export_failed`: a slow or dead collector never slows a request.
//!
//! Whose trace is continued: a client's `traceparent` is honoured (its trace id, its span
//! as the parent, its sampling decision) only from `trusted_proxies`, or on a listener
//! with `trust_trace_context: true`. From anyone else it would let any client choose what
//! is recorded (every request, at `sample_ratio: 0.01`) and join its spans to traces it
//! names; such a request starts a trace of its own, sampled at `sample_ratio`.

pub mod context;
mod export;
mod span;

pub use context::{RequestTrace, SpanHead};

use crate::observe::metrics::Metrics;
use crate::observe::record::Record;
use http::HeaderMap;
use opentelemetry::trace::SpanKind;
use opentelemetry_sdk::trace::{Sampler, SamplingDecision, ShouldSample};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tollgate_config::TracingConfig;

/// The handle requests trace through: the sampler, and the queue to the exporting task.
pub struct Spans {
    sampler: Sampler,
    queue: mpsc::Sender<Box<Record>>,
    flushes: mpsc::UnboundedSender<tokio::sync::oneshot::Sender<()>>,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for Spans {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Spans").finish_non_exhaustive()
    }
}

impl Spans {
    /// Starts the exporting task for `cfg` on `runtime`. An exporter that cannot be made
    /// (an endpoint the OTLP client refuses) is logged, and no trace is kept.
    pub fn start(
        cfg: &TracingConfig,
        metrics: Arc<Metrics>,
        runtime: &tokio::runtime::Handle,
    ) -> Option<Arc<Spans>> {
        let exporter = {
            let _entered = runtime.enter();
            match export::exporter(cfg) {
                Ok(e) => e,
                Err(e) => {
                    tracing::error!("tracing: cannot export to {}: {e}", cfg.endpoint);
                    return None;
                }
            }
        };
        let (queue, rx) = mpsc::channel(cfg.queue_size);
        let (flushes, flush_rx) = mpsc::unbounded_channel();
        runtime.spawn(export::run(
            exporter,
            rx,
            flush_rx,
            export::Batching {
                size: cfg.batch_size,
                every: cfg.export_interval,
                timeout: cfg.timeout,
            },
            metrics.clone(),
        ));
        Some(Arc::new(Spans {
            sampler: Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(cfg.sample_ratio))),
            queue,
            flushes,
            metrics,
        }))
    }

    /// The trace of a request with these `headers`: the client's continued when `trusted`
    /// and valid, else a new one; sampled as the parent says or at the ratio.
    pub fn begin(&self, headers: &HeaderMap, trusted: bool) -> RequestTrace {
        let parent = if trusted {
            context::extract(headers)
        } else {
            None
        };
        let (trace_id, parent_span) = match &parent {
            Some((cx, _)) => {
                use opentelemetry::trace::TraceContextExt;
                let sc = cx.span().span_context().clone();
                (sc.trace_id(), Some(sc.span_id()))
            }
            None => (context::new_trace_id(), None),
        };
        let decision = self
            .sampler
            .should_sample(
                parent.as_ref().map(|(cx, _)| cx),
                trace_id,
                "",
                &SpanKind::Server,
                &[],
                &[],
            )
            .decision;
        RequestTrace {
            trace_id,
            span_id: context::new_span_id(),
            sampled: decision == SamplingDecision::RecordAndSample,
            parent: parent_span,
            state: parent.and_then(|(_, s)| s),
        }
    }

    /// Queues a finished request's span; drops and counts it when the queue is full.
    pub fn end(&self, rec: Box<Record>) {
        if self.queue.try_send(rec).is_err() {
            self.metrics.trace_dropped_full.inc();
        }
    }

    /// Waits (at most `wait`) until the spans queued so far are exported or given up.
    pub async fn flush(&self, wait: Duration) -> bool {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if self.flushes.send(tx).is_err() {
            return false;
        }
        tokio::time::timeout(wait, rx)
            .await
            .is_ok_and(|r| r.is_ok())
    }
}
