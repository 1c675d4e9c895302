//! The answer's body, counted on its way out; its end queues the request's access log
//! line and its span.

use super::access_log::AccessLog;
use super::record::Record;
use super::trace::Spans;
use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

/// A request's record and where it goes when the answer is done: the access log, the
/// span exporter (a sampled request), or both.
pub struct Pending {
    /// The record.
    pub rec: Box<Record>,
    /// The access log, when on.
    pub log: Option<Arc<AccessLog>>,
    /// The span exporter, when the request is sampled.
    pub spans: Option<Arc<Spans>>,
}

impl Pending {
    /// Queues the record to the access log and ends the span, as of now.
    pub fn finish(self) {
        let Pending {
            mut rec,
            log,
            spans,
        } = self;
        rec.duration = rec.start.elapsed();
        match (log, spans) {
            (Some(log), Some(spans)) => {
                spans.end(&rec);
                log.log(rec);
            }
            (Some(log), None) => log.log(rec),
            (None, Some(spans)) => spans.end(&rec),
            (None, None) => {}
        }
    }
}

/// A response body that queues its request's access log line and span once it has been
/// sent (or dropped unfinished), counting the bytes on the way. Without a record it only
/// passes frames through.
pub struct Logged<B> {
    inner: B,
    pending: Option<Pending>,
}

impl<B> Logged<B> {
    /// `body`, handing its record on at its end when given.
    pub fn new(inner: B, pending: Option<Pending>) -> Self {
        Logged { inner, pending }
    }

    fn finish(&mut self) {
        if let Some(p) = self.pending.take() {
            p.finish();
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
                    if let (Some(d), Some(p)) = (f.data_ref(), this.pending.as_mut()) {
                        p.rec.bytes_out += d.len() as u64;
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
