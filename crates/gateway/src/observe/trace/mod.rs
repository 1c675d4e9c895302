//! OpenTelemetry traces: one server span per request, exported over OTLP.
//!
//! On the request path a trace costs a sampling decision, two random ids and a
//! `traceparent` header for the upstream. A recorded span is written from the request's
//! [`Record`] when the answer's body is done, on the request's thread, and added to a
//! bounded queue; a task exports the queued spans in batches. A full queue drops the span and counts it
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
pub(crate) mod otlp;

pub use context::{RequestTrace, SpanHead};

use crate::exchange::Fields;
use crate::observe::metrics::Metrics;
use crate::observe::record::Record;
use opentelemetry::trace::{SpanKind, TraceId};
use opentelemetry_sdk::trace::{Sampler, SamplingDecision, ShouldSample};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tollgate_config::TracingConfig;

/// The handle requests trace through: the sampler, and the queue to the exporting task.
pub struct Spans {
    /// For a continued trace: the parent's decision (OpenTelemetry's `ParentBased`).
    sampler: Sampler,
    /// For a new trace: recorded when the trace id's low 63 bits fall below this, as
    /// OpenTelemetry's `TraceIdRatioBased` decides (computed once here, since the SDK's
    /// sampler call costs five times the comparison on every request).
    root_bound: Option<u64>,
    /// The queue to the exporting task; none when no exporter could be made for the
    /// settings (then traces are still made and passed upstream, and their spans are
    /// counted as dropped).
    queue: Option<Arc<export::Queue>>,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for Spans {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Spans").finish_non_exhaustive()
    }
}

impl Spans {
    /// Starts the exporting task for `cfg` on `runtime`. When no exporter can be made for
    /// the settings (no trust roots for an `https://` collector, say), that is logged, and
    /// requests are still traced and their trace passed upstream as configured; their
    /// spans are counted as dropped (`export_failed`).
    pub fn start(
        cfg: &TracingConfig,
        metrics: Arc<Metrics>,
        runtime: &tokio::runtime::Handle,
    ) -> Arc<Spans> {
        let exporter = {
            let _entered = runtime.enter();
            export::exporter(cfg)
        };
        let queue = match exporter {
            Ok(exporter) => {
                let queue = Arc::new(export::Queue::new(cfg.queue_size, cfg.batch_size));
                runtime.spawn(export::run(
                    exporter,
                    queue.clone(),
                    export::Batching {
                        size: cfg.batch_size,
                        every: cfg.export_interval,
                        timeout: cfg.timeout,
                    },
                    cfg.service_name.clone(),
                    metrics.clone(),
                ));
                Some(queue)
            }
            Err(e) => {
                tracing::error!(
                    "tracing: cannot export to {}: {e}; spans are dropped (counted in tollgate_trace_spans_dropped_total)",
                    tollgate_config::redacted_url(&cfg.endpoint)
                );
                None
            }
        };
        Arc::new(Spans {
            sampler: Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(cfg.sample_ratio))),
            root_bound: (cfg.sample_ratio < 1.0)
                .then(|| (cfg.sample_ratio.max(0.0) * (1u64 << 63) as f64) as u64),
            queue,
            metrics,
        })
    }

    /// Whether spans are exported (an exporter could be made for the settings).
    pub fn exporting(&self) -> bool {
        self.queue.is_some()
    }

    /// The trace of a request with these `headers`: the client's continued when `trusted`
    /// and valid, else a new one (its id `fresh`, random bits the caller drew, when given
    /// and not zero); sampled as the parent says or at the ratio.
    pub fn begin(&self, headers: &Fields, trusted: bool, fresh: Option<u128>) -> RequestTrace {
        let span_id = context::new_span_id();
        // A trusted client's valid trace: continued, its sampling decision honoured.
        if let Some((cx, state)) = trusted.then(|| context::extract(headers)).flatten() {
            use opentelemetry::trace::TraceContextExt;
            let (trace_id, parent) = {
                let sc = cx.span();
                (sc.span_context().trace_id(), sc.span_context().span_id())
            };
            let sampled = self
                .sampler
                .should_sample(Some(&cx), trace_id, "", &SpanKind::Server, &[], &[])
                .decision
                == SamplingDecision::RecordAndSample;
            return RequestTrace {
                trace_id,
                span_id,
                sampled,
                parent: Some(parent),
                state,
                id_from_request: false,
            };
        }
        // A new trace: the request id's bits when given, sampled at the ratio.
        let fresh = fresh.filter(|n| *n != 0);
        let trace_id = fresh.map_or_else(context::new_trace_id, TraceId::from);
        let low = u128::from_be_bytes(trace_id.to_bytes()) as u64;
        RequestTrace {
            trace_id,
            span_id,
            sampled: self.root_bound.is_none_or(|bound| low >> 1 < bound),
            parent: None,
            state: None,
            id_from_request: fresh.is_some(),
        }
    }

    /// Writes and queues a finished request's span; drops and counts it when the queue is
    /// full.
    pub fn end(&self, rec: &Record) {
        match &self.queue {
            Some(q) => {
                if !q.push(rec) {
                    self.metrics.trace_dropped_full.inc();
                }
            }
            None => {
                self.metrics.trace_dropped_failed.inc();
            }
        }
    }

    /// Waits (at most `wait`) until the spans queued so far are exported or given up.
    pub async fn flush(&self, wait: Duration) -> bool {
        let Some(queue) = &self.queue else {
            return false;
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        queue.flushes.lock().push(tx);
        queue.wake.notify_one();
        tokio::time::timeout(wait, rx)
            .await
            .is_ok_and(|r| r.is_ok())
    }
}

impl Drop for Spans {
    /// The exporting task sends what is left and stops.
    fn drop(&mut self) {
        if let Some(q) = &self.queue {
            q.closed.store(true, Ordering::Release);
            q.wake.notify_one();
        }
    }
}
