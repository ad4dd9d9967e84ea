//! What can go wrong in the core, by kind: the kind decides how a caller reacts (the `gpuexp`
//! command exits 3 only without a driver; Python gets one exception class per kind), the message
//! says what happened and how to fix it.

use std::fmt;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Error {
    /// NVIDIA's management library cannot be loaded or initialised: no driver on this machine,
    /// or none this process can load.
    NoDriver(String),
    /// The library is there, but one of its calls failed (a device vanished, a query refused).
    Nvml(String),
    /// Bad input from the user; the message names the fix.
    InvalidArgument(String),
    /// A file or the terminal could not be written or read; the message names the path.
    Io(String),
    /// The caller asked a long job to stop (Ctrl-C): the bindings raise the interrupt itself.
    Interrupted,
}

pub type Result<T> = std::result::Result<T, Error>;

/// The message alone: the kind is for programs, which match on it.
impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::NoDriver(message) | Error::Nvml(message) | Error::InvalidArgument(message) | Error::Io(message) => {
                f.write_str(message)
            }
            Error::Interrupted => f.write_str("interrupted"),
        }
    }
}

impl std::error::Error for Error {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_shows_its_message_alone() {
        let error = Error::Io("--log /x/w.csv: cannot write there (No such file or directory)".into());
        assert_eq!(error.to_string(), "--log /x/w.csv: cannot write there (No such file or directory)");
        let boxed: Box<dyn std::error::Error> = Box::new(Error::NoDriver("no NVIDIA driver".into()));
        assert_eq!(boxed.to_string(), "no NVIDIA driver");
    }
}
