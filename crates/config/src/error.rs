//! Config errors: each problem carries its place in the file as a path (`routes[2].upstream`).

use std::fmt;

/// One problem found in a config file, with its place in the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// Where in the file, as a path such as `routes[2].upstream` (empty for the whole file).
    pub path: String,
    /// What is wrong, and where it helps, what to do.
    pub message: String,
}

impl Problem {
    /// A problem at `path`. A URL quoted in `message` is shown without its credentials
    /// (it reaches `tollgate check`, the log, `/status` and the admin API's answers).
    pub fn new(path: impl Into<String>, message: impl Into<String>) -> Self {
        let message: String = message.into();
        let message = match crate::redacted_text(&message) {
            std::borrow::Cow::Borrowed(_) => message,
            std::borrow::Cow::Owned(shown) => shown,
        };
        Problem {
            path: path.into(),
            message,
        }
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            write!(f, "{}", self.message)
        } else {
            write!(f, "{}: {}", self.path, self.message)
        }
    }
}

/// Why a config could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file's path.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The YAML is malformed or does not fit the schema (unknown field, wrong type).
    #[error("{0}")]
    Syntax(Problem),
    /// The file parsed but its content is not valid; every problem found is listed, and
    /// beside them what would only have been warned of had the file been valid.
    #[error("{}", list(problems))]
    Invalid {
        /// What makes the file invalid.
        problems: Vec<Problem>,
        /// What is taken as written but is likely a mistake.
        warnings: Vec<Problem>,
    },
}

impl ConfigError {
    /// Every problem, one per entry (a read error has none with a path).
    pub fn problems(&self) -> Vec<Problem> {
        match self {
            ConfigError::Read { .. } => vec![Problem::new("", self.to_string())],
            ConfigError::Syntax(p) => vec![p.clone()],
            ConfigError::Invalid { problems, .. } => problems.clone(),
        }
    }

    /// What validation warned of beside the problems (none for a file it did not reach).
    pub fn warnings(&self) -> &[Problem] {
        match self {
            ConfigError::Invalid { warnings, .. } => warnings,
            _ => &[],
        }
    }

    /// Problems alone, no warnings: what a file that cannot be parsed or read reports.
    pub fn invalid(problems: Vec<Problem>) -> Self {
        ConfigError::Invalid {
            problems,
            warnings: Vec::new(),
        }
    }
}

fn list(problems: &[Problem]) -> String {
    problems
        .iter()
        .map(|p| p.to_string())
        .collect::<Vec<_>>()
        .join("; ")
}
