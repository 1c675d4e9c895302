//! What one connection measured: latencies, send lag, statuses and errors.

use crate::client::ErrorKind;
use hdrhistogram::Histogram;

/// Per-connection results, merged at the end.
pub struct Tally {
    pub(crate) latency: Histogram<u64>,
    pub(crate) lag: Histogram<u64>,
    pub(crate) statuses: Vec<u64>,
    pub(crate) errors: [u64; ErrorKind::ALL.len()],
    /// Open loop: requests due before the end that no connection was free to send in time.
    pub(crate) unsent: u64,
}

impl Tally {
    pub(crate) fn new() -> Tally {
        // Constant, valid bounds: 1 ns to 1 h at 3 significant digits.
        let h = || {
            Histogram::<u64>::new_with_bounds(1, 3_600_000_000_000, 3)
                .expect("constant histogram bounds are valid")
        };
        Tally {
            latency: h(),
            lag: h(),
            statuses: vec![0; 600],
            errors: [0; ErrorKind::ALL.len()],
            unsent: 0,
        }
    }

    pub(crate) fn merge(&mut self, o: &Tally) {
        let _ = self.latency.add(&o.latency);
        let _ = self.lag.add(&o.lag);
        for (a, b) in self.statuses.iter_mut().zip(&o.statuses) {
            *a += b;
        }
        for (a, b) in self.errors.iter_mut().zip(&o.errors) {
            *a += b;
        }
        self.unsent += o.unsent;
    }
}
