//! What validation found, each with its place in the file.

use crate::error::Problem;

/// What validation found: problems (the config is refused) and warnings (it is taken, and
/// the operator told).
#[derive(Default)]
pub(crate) struct Problems(pub(crate) Vec<Problem>, pub(crate) Vec<Problem>);

impl Problems {
    pub(crate) fn add(&mut self, path: impl Into<String>, msg: impl Into<String>) {
        self.0.push(Problem::new(path, msg));
    }

    /// Something that is taken as written but is likely a mistake.
    pub(crate) fn warn(&mut self, path: impl Into<String>, msg: impl Into<String>) {
        self.1.push(Problem::new(path, msg));
    }
}
