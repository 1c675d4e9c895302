//! The limiter's figures for `/metrics`: limit cells in use, and the state file's writes.

use super::live::Live;
use super::persist::StateStats;
use crate::observe::scrape::{counter, gauge, DescriptorEncoder, Report};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Weak;

/// The number of limit cells in use, while the limiter is.
#[derive(Debug)]
pub struct CellCount(pub Weak<Live>);

impl Report for CellCount {
    fn report(&self, e: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
        let Some(cells) = self.0.upgrade() else {
            return Ok(());
        };
        gauge(
            e,
            "limit_cells",
            "Limit counter cells in use (made when a consumer calls again within a window, retired once idle).",
            cells.len() as u64,
        )?;
        Ok(())
    }
}

impl Report for StateStats {
    fn report(&self, e: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
        let st = self;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        counter(
            e,
            "state_flushes",
            "Rounds of writing limit counters to the state file (written or found nothing to write).",
            load(&st.flushes),
        )?;
        counter(
            e,
            "state_windows_written",
            "Limit windows written to the state file.",
            load(&st.windows),
        )?;
        counter(
            e,
            "state_errors",
            "State file opens or writes that failed (the gateway keeps serving).",
            load(&st.errors),
        )?;
        Ok(())
    }
}
