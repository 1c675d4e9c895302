//! The cache's figures for `/metrics`: what is stored, and how requests were answered.

use super::Cache;
use crate::observe::scrape::{counter, gauge, DescriptorEncoder, Report};
use std::sync::atomic::{AtomicU64, Ordering};

impl Report for Cache {
    fn report(&self, e: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
        let cache = self;
        let store = &cache.store;
        let (entries, bytes) = store.usage();
        let cm = &store.metrics;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        gauge(e, "cache_entries", "Responses stored.", entries)?;
        gauge(e, "cache_bytes", "Bytes the stored responses take.", bytes)?;
        gauge(
            e,
            "cache_index_uris",
            "URIs with something stored, in the cache's index.",
            store.index_len() as u64,
        )?;
        gauge(
            e,
            "cache_waiting",
            "Requests waiting now for another request's fetch of the same key.",
            load(&cm.waiting),
        )?;
        for (name, help, v) in [
            ("cache_hits", "Answered from the cache.", &cm.hits),
            (
                "cache_misses",
                "Went upstream for want of a usable entry.",
                &cm.misses,
            ),
            (
                "cache_stale",
                "Answered stale (while revalidating, or the upstream failed).",
                &cm.stale,
            ),
            (
                "cache_revalidated",
                "Stale entries renewed by a 304.",
                &cm.revalidated,
            ),
            (
                "cache_coalesced",
                "Answered from another request's fetch of the same key.",
                &cm.coalesced,
            ),
            ("cache_stored", "Responses stored.", &cm.stored),
            (
                "cache_evictions",
                "Entries evicted to make room.",
                &cm.evictions,
            ),
            (
                "cache_purged",
                "Entries removed by purges and unsafe methods.",
                &cm.purged,
            ),
        ] {
            counter(e, name, help, load(v))?;
        }
        Ok(())
    }
}
