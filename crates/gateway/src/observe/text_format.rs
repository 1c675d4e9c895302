//! `/metrics` for scrapers that do not ask for OpenMetrics: the same figures in the
//! Prometheus text format 0.0.4, which prometheus-client does not write. The two differ in
//! three places only: a counter's `# HELP` and `# TYPE` name its samples (`x_total`, not
//! `x`), there is no `# UNIT`, and no `# EOF`. Prometheus asks for OpenMetrics and gets it;
//! `curl`, Telegraf and other text-format readers get this.

/// The content type of [`from_openmetrics`]'s text.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Whether a scraper's `Accept` asks for OpenMetrics: named with a `q` above zero and no
/// lower than the best the text format gets (`text/plain`, `text/*`, `*/*`). A tie goes to
/// OpenMetrics, which the scraper named.
pub fn wants_openmetrics(accept: Option<&[u8]>) -> bool {
    let Some(accept) = accept.and_then(|a| std::str::from_utf8(a).ok()) else {
        return false;
    };
    let (mut om, mut text) = (None::<f32>, 0.0f32);
    for range in accept.split(',') {
        let mut parts = range.split(';');
        let kind = parts.next().unwrap_or("").trim();
        let q = parts
            .filter_map(|p| p.split_once('='))
            .find(|(k, _)| k.trim().eq_ignore_ascii_case("q"))
            .map_or(1.0, |(_, v)| v.trim().parse::<f32>().unwrap_or(0.0));
        if kind.eq_ignore_ascii_case("application/openmetrics-text") {
            om = Some(om.map_or(q, |o| o.max(q)));
        } else if ["text/plain", "text/*", "*/*"]
            .iter()
            .any(|t| kind.eq_ignore_ascii_case(t))
        {
            text = text.max(q);
        }
    }
    om.is_some_and(|o| o > 0.0 && o >= text)
}

/// `text`, OpenMetrics as prometheus-client writes it, in the text format 0.0.4.
pub fn from_openmetrics(text: &str) -> String {
    let counters: std::collections::HashSet<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(text.len() + 64 * counters.len());
    for line in text.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let described = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| Some((p, line.strip_prefix(p)?)));
        match described {
            Some((prefix, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                out.push_str(prefix);
                out.push_str(name);
                if counters.contains(name) {
                    out.push_str("_total");
                }
                if !tail.is_empty() {
                    out.push(' ');
                    out.push_str(tail);
                }
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_are_named_by_their_samples_and_openmetrics_lines_go() {
        let om = "# HELP tollgate_requests Requests.\n# TYPE tollgate_requests counter\ntollgate_requests_total{route=\"a\"} 3\n# HELP tollgate_up Up.\n# TYPE tollgate_up gauge\n# UNIT tollgate_up seconds\ntollgate_up 1\n# HELP tollgate_d Time.\n# TYPE tollgate_d histogram\ntollgate_d_bucket{le=\"+Inf\"} 1\ntollgate_d_sum 0.5\ntollgate_d_count 1\n# EOF\n";
        assert_eq!(
            from_openmetrics(om),
            "# HELP tollgate_requests_total Requests.\n# TYPE tollgate_requests_total counter\ntollgate_requests_total{route=\"a\"} 3\n# HELP tollgate_up Up.\n# TYPE tollgate_up gauge\ntollgate_up 1\n# HELP tollgate_d Time.\n# TYPE tollgate_d histogram\ntollgate_d_bucket{le=\"+Inf\"} 1\ntollgate_d_sum 0.5\ntollgate_d_count 1\n"
        );
        assert!(wants_openmetrics(Some(
            b"application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
        )));
        assert!(!wants_openmetrics(Some(b"*/*")));
        assert!(!wants_openmetrics(None));
        // What Prometheus 3 sends: OpenMetrics first by its q.
        assert!(wants_openmetrics(Some(
            b"application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,application/openmetrics-text;version=0.0.1;q=0.5,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2"
        )));
        // Named, but ranked below the text format, or refused outright.
        assert!(!wants_openmetrics(Some(
            b"text/plain, application/openmetrics-text;q=0.5"
        )));
        assert!(!wants_openmetrics(Some(
            b"application/openmetrics-text;q=0"
        )));
        assert!(!wants_openmetrics(Some(
            b"application/openmetrics-text; q=0.2, */*; q=0.9"
        )));
        assert!(wants_openmetrics(Some(b"Application/OpenMetrics-Text")));
    }
}
