//! The response cache, after every policy (a hit is counted against the consumer's limits
//! like a proxied call and never reaches a caller the route refuses):
//!
//! - fresh entry: answered here (`Age`, `Cache-Status: tollgate; hit; ttl=N`), 304 to a
//!   client whose `If-None-Match` / `If-Modified-Since` it satisfies, HEAD from a stored GET;
//! - stale within `stale-while-revalidate`: answered stale, refreshed once in the background;
//! - stale otherwise: revalidated with the stored validators (a 304 refreshes the entry) by
//!   one request while the others for the key wait for it; when the upstream fails or
//!   answers 5xx within `stale-if-error`, answered stale (the waiting ones too);
//! - miss: concurrent requests for one key wait for the first one's answer (bounded by the
//!   upstream's `response_timeout`) and are served from it, or go upstream themselves if it
//!   was not stored; the first streams its answer to its client and stores a copy at its end.
//!
//! With `shared: false` every consumer has entries of its own; with `shared: true`, one
//! entry serves every consumer the route allows, except responses that vary by consumer
//! (`Vary` on the consumer header). Only the consumer's name is part of a key, never its key.

pub(crate) mod answer;
pub mod control;
mod fill;
mod inflight;
mod key;
mod report;
mod revalidate;
mod serve;
pub mod store;

pub use answer::{forwarded, only_if_cached as not_cached, own_status, CACHE_STATUS};
pub use fill::PASS_STATUS;
pub(crate) use inflight::resolve;
pub use inflight::went_upstream;
pub use inflight::{Cache, Fetch, Keying, Purge};
pub use key::{is_unsafe, only_if_cached, overrides_method, overrides_to_unsafe, Ask, Key};
