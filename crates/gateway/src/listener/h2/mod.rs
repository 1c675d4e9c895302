//! The HTTP/2 server (RFC 9113, HPACK RFC 7541), made for the gateway's request path:
//! each connection's streams run in the connection's task, requests are built straight
//! from HPACK fields kept parsed in its table, answers go out as plain literals, and the
//! frames of many answers leave in one write. It speaks only what a server must: no push,
//! no priorities (parsed and checked, not acted on), no extended CONNECT.
//!
//! Its limits are the listener's `http2` settings (streams, header list, windows, resets);
//! beyond them are the flood guards: a client that resets streams faster than it lets
//! them be answered, or makes the server reset them (CVE-2023-44487, CVE-2025-8671),
//! endless CONTINUATION (CVE-2024-27316), frames that carry nothing, replies it does not
//! read (nothing more is read while 64 KiB wait to be written), and more than 64 streams
//! refused or malformed all end in GOAWAY.

pub mod body;
mod conn;
mod exec;
mod frame;
pub(crate) mod hpack;
mod huffman;
mod request;

pub use conn::{held_headers, Connection, Limits};
pub(crate) use frame::PREFACE;
