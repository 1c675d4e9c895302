//! The HTTP/1.1 server, made for the request path: the head is parsed by `httparse` from
//! the connection's one read buffer (names and values are slices of it), bodies are read
//! for the handler only as it asks, answers are framed here and leave with their head in
//! one write when small, and one deadline per connection covers the wait for a head.
//!
//! Framing is where request smuggling lives, so the head is refused when it is ambiguous:
//! `Transfer-Encoding` other than exactly `chunked` (501), given twice or on HTTP/1.0,
//! `Content-Length` that is not digits or disagrees with another, and chunk framing that is
//! not exact (see [`chunked`]). The fuzz target `h1_framing` holds the decisions against
//! hyper's parser.

pub mod chunked;
pub mod date;
pub mod head;
pub mod recv;
pub mod send;
mod serve;
pub mod upgrade;

pub use serve::serve;
pub use upgrade::OnUpgrade;
