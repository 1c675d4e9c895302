//! tollgate's configuration: the YAML file as written ([`file`]), and the validated
//! [`Config`] the gateway runs on ([`model`]).
//!
//! Loading is two steps: the text is deserialized into file types (unknown fields are
//! rejected), then validated into runtime types. Validation reports every problem at
//! once, each with its place in the file (`routes[2].upstream: unknown upstream "orders"`).
#![forbid(unsafe_code)]

pub mod error;
pub mod file;
pub mod model;
pub mod units;
mod validate;

pub use error::{ConfigError, Problem};
pub use model::*;

use std::path::Path;

/// Parses and validates a config from YAML text.
pub fn from_yaml(text: &str) -> Result<Config, ConfigError> {
    let de = serde_yaml_ng::Deserializer::from_str(text);
    let raw: file::FileConfig = serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let message = e.into_inner().to_string();
        // The YAML error already names its place ("routes[0]: ... at line 12 column 5")
        // when it can; otherwise prefix the path serde walked to.
        if path == "." || message.contains(" at line ") {
            ConfigError::Syntax(Problem::new("", message))
        } else {
            ConfigError::Syntax(Problem::new(path, message))
        }
    })?;
    validate::validate(raw)
}

/// Reads, parses and validates a config file.
pub fn from_path(path: &Path) -> Result<Config, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Read {
        path: path.display().to_string(),
        source: e,
    })?;
    from_yaml(&text)
}
