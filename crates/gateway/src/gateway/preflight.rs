//! What `tollgate check` reads beside the config, as a start reads it: the consumer change
//! log (a damaged line, a key or a plan the config and the log disagree on) and the routes'
//! `jwks_file` keys. A config that passes here starts, and a start's warnings are said.

use tollgate_config::{Config, JwtKeys, Problem};

/// Problems (the start would stop, or a reload be refused) and warnings (the gateway
/// starts and says so) found beside `config`.
#[derive(Debug, Default)]
pub struct Findings {
    /// What stops a start.
    pub problems: Vec<Problem>,
    /// What a start logs as a warning or an error and serves on.
    pub warnings: Vec<Problem>,
}

/// Reads what `config` names beside itself, as a start would, without taking anything (a
/// running gateway may keep the change log).
pub fn preflight(config: &Config) -> Findings {
    let mut found = Findings::default();
    if let Some(path) = &config.consumers_log {
        match crate::roster::Roster::read(path) {
            Ok(roster) => {
                // A key of two consumers stops a start; a plan gone leaves its managed
                // consumers refused (503), which a start says and serves on (a reload to
                // such a config is refused).
                found.problems.extend(roster.key_conflicts(config));
                found.warnings.extend(roster.missing_plans(config));
            }
            Err(e) => {
                use std::io::ErrorKind as K;
                let why = format!(
                    "cannot keep the consumer change log {}: {e}",
                    path.display()
                );
                // As a start: the default log beside the config, where it cannot be read,
                // leaves the consumers managed through the admin API in memory only.
                if config.consumers_log_implied
                    && matches!(e.kind(), K::PermissionDenied | K::NotFound)
                {
                    found.warnings.push(Problem::new(
                        "consumers_log",
                        format!("{why}; consumers managed through the admin API would be kept in memory only"),
                    ));
                } else {
                    found.problems.push(Problem::new("consumers_log", why));
                }
            }
        }
    }
    for (i, route) in config.routes.iter().enumerate() {
        let Some(jwt) = route.auth.as_ref().and_then(|a| a.jwt.as_ref()) else {
            continue;
        };
        if let JwtKeys::File(text) = &jwt.keys {
            for said in crate::jwks::file_findings(text) {
                found.warnings.push(Problem::new(
                    format!("routes[{i}].auth.jwt.jwks_file"),
                    said,
                ));
            }
        }
    }
    found
}
