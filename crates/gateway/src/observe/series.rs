//! The last minutes of the gateway's own series, for the dashboard's charts: once a second
//! (while the admin listener runs), the request count and the latency histogram's buckets,
//! so that a page opened now draws the last five minutes at once instead of starting empty.

use parking_lot::Mutex;
use std::collections::VecDeque;

/// Samples kept: five minutes at one a second.
const KEPT: usize = 300;

/// One second's reading of the counters.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Sample {
    /// Wall-clock seconds on the gateway's clock.
    pub t: u64,
    /// Requests answered since start (`tollgate_requests_total`, all labels).
    pub requests: f64,
    /// The request-duration histogram's cumulative buckets, summed over routes: `(le,
    /// count)` with `+Inf` last.
    pub buckets: Vec<(String, f64)>,
}

/// The kept samples, oldest first.
#[derive(Debug, Default)]
pub struct Series {
    samples: Mutex<VecDeque<Sample>>,
}

impl Series {
    /// Takes a sample at `t` from the `/metrics` text; one a second at most (a second
    /// sample in the same second replaces the first).
    pub fn sample(&self, t: u64, metrics: &str) {
        let mut requests = 0.0;
        let mut buckets: Vec<(String, f64)> = Vec::new();
        for line in metrics.lines() {
            let Some((head, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(v) = value.parse::<f64>() else {
                continue;
            };
            if head.starts_with("tollgate_requests_total{") {
                requests += v;
            } else if let Some(rest) =
                head.strip_prefix("tollgate_request_duration_seconds_bucket{")
            {
                let Some(le) = rest.split("le=\"").nth(1).and_then(|r| r.split('"').next()) else {
                    continue;
                };
                match buckets.iter_mut().find(|(l, _)| l == le) {
                    Some((_, n)) => *n += v,
                    None => buckets.push((le.to_string(), v)),
                }
            }
        }
        let mut samples = self.samples.lock();
        if samples.back().is_some_and(|s| s.t == t) {
            samples.pop_back();
        }
        if samples.len() == KEPT {
            samples.pop_front();
        }
        samples.push_back(Sample {
            t,
            requests,
            buckets,
        });
    }

    /// The kept samples, oldest first.
    pub fn samples(&self) -> Vec<Sample> {
        self.samples.lock().iter().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_sum_routes_and_keep_five_minutes() {
        let s = Series::default();
        let text = "tollgate_requests_total{route=\"a\",method=\"GET\",class=\"2xx\"} 3\n\
                    tollgate_requests_total{route=\"b\",method=\"GET\",class=\"4xx\"} 2\n\
                    tollgate_request_duration_seconds_bucket{le=\"0.001\",route=\"a\"} 1\n\
                    tollgate_request_duration_seconds_bucket{le=\"0.001\",route=\"b\"} 2\n\
                    tollgate_request_duration_seconds_bucket{le=\"+Inf\",route=\"a\"} 3\n";
        for t in 0..400 {
            s.sample(t, text);
        }
        s.sample(399, text);
        let all = s.samples();
        assert_eq!(all.len(), KEPT);
        assert_eq!(all[0].t, 100);
        assert_eq!(all[KEPT - 1].requests, 5.0);
        assert_eq!(
            all[KEPT - 1].buckets,
            [("0.001".to_string(), 3.0), ("+Inf".to_string(), 3.0)]
        );
    }
}
