//! Fuzz harnesses for the gateway's hand-written parsers: one `fn(&[u8])` per target of
//! `fuzz/` (`cargo +nightly fuzz run <target>`), replayed on stable over the committed
//! corpora by `tests/fuzz_corpus.rs`. Each panics when an invariant breaks, so that a
//! fuzzer reports it; none of this is used by the gateway itself.

mod cache;
#[cfg(test)]
mod fields_props;
mod h1_server;
mod h2;
#[cfg(test)]
mod hop_props;
mod inbound;
mod otlp;
#[cfg(test)]
mod props;
mod runtime;
mod upstream_h1;

pub use cache::{cache_control, range_query};
pub use h1_server::h1_framing;
pub use h2::{h2_frames, hpack};
pub use inbound::{check_host, check_path, path_host};
pub use otlp::otlp_span;
pub use upstream_h1::upstream_h1;
