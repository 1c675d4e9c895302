//! A list of limits: N requests per window, each named once.

use super::problems::Problems;
use crate::file;
use crate::model::LimitConfig;
use std::collections::HashSet;
use std::time::Duration;

const MIN_WINDOW: Duration = Duration::from_secs(1);
const MAX_WINDOW: Duration = Duration::from_secs(30 * 86_400);

/// The limits of `raw` (found at `at`), with their problems noted in `p`.
pub(crate) fn limits(raw: &[file::Limit], at: &str, p: &mut Problems) -> Vec<LimitConfig> {
    let mut names = HashSet::new();
    let mut out = Vec::new();
    for (i, l) in raw.iter().enumerate() {
        let at = format!("{at}[{i}]");
        if l.requests == 0 {
            p.add(
                format!("{at}.requests"),
                "must be at least 1 (to block a consumer, leave it out of `allow`)",
            );
        }
        if l.per.0 < MIN_WINDOW || l.per.0 > MAX_WINDOW {
            p.add(format!("{at}.per"), "must be between 1s and 30d");
        } else if l.per.0.subsec_nanos() != 0 {
            p.add(format!("{at}.per"), "must be a whole number of seconds");
        }
        let name = l
            .name
            .clone()
            .unwrap_or_else(|| format!("{}-per-{}", l.requests, human_window(l.per.0)));
        // It goes into the `RateLimit` headers as a quoted string and into 429 bodies as a
        // JSON string: printable ASCII without the two characters either would escape.
        if name.is_empty()
            || !name
                .bytes()
                .all(|b| (b' '..=b'~').contains(&b) && b != b'"' && b != b'\\')
        {
            p.add(
                format!("{at}.name"),
                "must be non-empty printable ASCII without quotes or backslashes (it is sent in the RateLimit headers)",
            );
        }
        if !names.insert(name.clone()) {
            p.add(
                format!("{at}.name"),
                format!("limit name {name:?} is used twice here"),
            );
        }
        out.push(LimitConfig {
            counted_as: name.clone(),
            name,
            requests: l.requests,
            window: l.per.0,
        });
    }
    // An unnamed limit is counted by its window, unless that is ambiguous in the list.
    let by_window = |l: &file::Limit| format!("per-{}", human_window(l.per.0));
    for (l, c) in raw.iter().zip(out.iter_mut()) {
        if l.name.is_some() {
            continue;
        }
        let id = by_window(l);
        let alone = raw
            .iter()
            .filter(|o| o.name.is_none() && o.per.0 == l.per.0)
            .count()
            == 1;
        if alone && !names.contains(&id) {
            c.counted_as = id;
        }
    }
    out
}

/// `10s`, `5m`, `1h`, `30d`: the shortest exact form.
fn human_window(d: Duration) -> String {
    let s = d.as_secs();
    for (unit, len) in [("d", 86_400), ("h", 3_600), ("m", 60)] {
        if s >= len && s.is_multiple_of(len) {
            return format!("{}{unit}", s / len);
        }
    }
    format!("{s}s")
}
