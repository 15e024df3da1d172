//! Configuration errors, naming the field at fault (apart from request errors; re-exported by
//! `config`, kept below it so that each section's owner can validate without importing it).

/// A configuration problem, naming the field at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The file is not valid TOML for this schema (the message names the key and line).
    #[error("invalid config file {path}: {message}")]
    Parse {
        /// The file.
        path: String,
        /// toml's message, naming the key.
        message: String,
    },
    /// A field has an invalid value.
    #[error("invalid `{field}`: {message}")]
    Field {
        /// Dotted path of the field, e.g. `prefill[1].url`.
        field: String,
        /// What is wrong.
        message: String,
    },
}

impl ConfigError {
    /// The same error, naming `path` as the file parsed.
    pub(crate) fn in_file(self, path: &str) -> ConfigError {
        match self {
            ConfigError::Parse { message, .. } => ConfigError::Parse {
                path: path.to_string(),
                message,
            },
            other => other,
        }
    }
}

pub(crate) fn field_error(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Field {
        field: field.into(),
        message: message.into(),
    }
}
