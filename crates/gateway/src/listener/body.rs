//! The body of a client's request, whichever protocol brought it: the HTTP/1.1 server's
//! ([`super::h1::recv::H1RecvBody`]) or the HTTP/2 server's ([`super::h2::RecvBody`]) for HTTP/2.

pub use super::body_error::RequestBodyError;
use super::h2::body::{HeldBytes, RecvBody};
use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use std::pin::Pin;
use std::task::{Context, Poll};

/// A request body as the gateway reads it.
pub enum RequestBody {
    /// From an HTTP/1.1 connection.
    Http1(super::h1::recv::H1RecvBody),
    /// From an HTTP/2 stream that carries one.
    Http2(RecvBody),
    /// None: an HTTP/2 request whose headers ended the stream.
    Empty,
}

/// Request-body bytes read ahead and still held, counted against their HTTP/2
/// connection's `max_request_buffer` until this is dropped.
#[derive(Default)]
pub struct Held {
    /// Given back on drop.
    _bytes: Option<HeldBytes>,
}

impl RequestBody {
    /// While on, what is read is held in the gateway before the request goes upstream:
    /// counted against an HTTP/2 connection's `max_request_buffer`.
    pub fn buffering(&mut self, on: bool) {
        if let RequestBody::Http2(b) = self {
            b.buffering(on);
        }
    }

    /// Stops counting what is read against the budget and hands over what was counted,
    /// to be given back when the pieces read are done with (see [`Held`]).
    pub fn keep_held(&mut self) -> Held {
        match self {
            RequestBody::Http2(b) => Held {
                _bytes: b.keep_held(),
            },
            _ => Held::default(),
        }
    }

    /// Whether more of the body may be read ahead and held (always on HTTP/1.1, which
    /// carries one request at a time).
    pub fn may_buffer(&self) -> bool {
        match self {
            RequestBody::Http2(b) => b.may_buffer(),
            _ => true,
        }
    }
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = RequestBodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, RequestBodyError>>> {
        match self.get_mut() {
            RequestBody::Http1(b) => b
                .poll_frame(cx)
                .map(|f| f.map(|r| r.map_err(RequestBodyError::from))),
            RequestBody::Http2(b) => Pin::new(b).poll_frame(cx),
            RequestBody::Empty => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            RequestBody::Http1(b) => b.is_end_stream(),
            RequestBody::Http2(b) => b.is_end_stream(),
            RequestBody::Empty => true,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            RequestBody::Http1(b) => b.size_hint(),
            RequestBody::Http2(b) => b.size_hint(),
            RequestBody::Empty => SizeHint::with_exact(0),
        }
    }
}
