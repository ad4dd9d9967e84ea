//! What `trace=` asks to record: torch's CUDA allocation history, the host's Python allocations
//! (tracemalloc), both, or neither. Host tracing is its own choice because tracemalloc slows
//! Python-heavy code (every allocation records its frames); the CUDA history costs little.

use crate::error::{Error, Result};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TraceKinds {
    #[default]
    Off,
    /// `trace=True` or `"cuda"`.
    Cuda,
    /// `trace="host"`.
    Host,
    /// `trace="all"`.
    All,
}

/// The error for any value `trace=` does not take (`got`: as the user wrote it).
pub fn rejected(got: &str) -> Error {
    Error::InvalidArgument(format!(
        "trace must be True or False, or one of \"cuda\" (the same as True), \"host\" (Python's allocations \
         by line, through tracemalloc) or \"all\" (both), e.g. GPUExperiment('bs=64', trace=\"all\"); got {got}"
    ))
}

impl TraceKinds {
    pub fn from_bool(on: bool) -> TraceKinds {
        if on {
            TraceKinds::Cuda
        } else {
            TraceKinds::Off
        }
    }

    /// `"cuda"`, `"host"` or `"all"`.
    pub fn parse(text: &str) -> Result<TraceKinds> {
        match text {
            "cuda" => Ok(TraceKinds::Cuda),
            "host" => Ok(TraceKinds::Host),
            "all" => Ok(TraceKinds::All),
            _ => Err(rejected(&format!("{text:?}"))),
        }
    }

    pub fn cuda(self) -> bool {
        matches!(self, TraceKinds::Cuda | TraceKinds::All)
    }

    pub fn host(self) -> bool {
        matches!(self, TraceKinds::Host | TraceKinds::All)
    }

    /// What a scope records: `asked` (its `trace=`), else the setting's `default`; a scope
    /// without GPUs records the host part alone, and refuses to be asked for CUDA.
    pub fn for_scope(asked: Option<TraceKinds>, default: TraceKinds, gpu: bool) -> Result<TraceKinds> {
        match asked {
            Some(kinds) if !gpu && kinds.cuda() => Err(Error::InvalidArgument(
                "a CPUExperiment has no GPU to trace: trace=\"host\" traces Python's allocations by line".into(),
            )),
            Some(kinds) => Ok(kinds),
            None if gpu => Ok(default),
            None if default.host() => Ok(TraceKinds::Host),
            None => Ok(TraceKinds::Off),
        }
    }

    /// As `gpuexp.config()` gives it back: the bool where it is one (`"cuda"` reads as True).
    pub fn setting(self) -> Option<&'static str> {
        match self {
            TraceKinds::Off | TraceKinds::Cuda => None,
            TraceKinds::Host => Some("host"),
            TraceKinds::All => Some("all"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_accepted_value_reads_as_its_kinds() {
        assert_eq!(TraceKinds::from_bool(true), TraceKinds::Cuda);
        assert_eq!(TraceKinds::from_bool(false), TraceKinds::Off);
        assert_eq!(TraceKinds::parse("cuda"), Ok(TraceKinds::Cuda));
        assert_eq!(TraceKinds::parse("host"), Ok(TraceKinds::Host));
        assert_eq!(TraceKinds::parse("all"), Ok(TraceKinds::All));
        let all = TraceKinds::All;
        assert!(all.cuda() && all.host());
        assert!(TraceKinds::Cuda.cuda() && !TraceKinds::Cuda.host());
        assert!(!TraceKinds::Host.cuda() && TraceKinds::Host.host());
        assert!(!TraceKinds::Off.cuda() && !TraceKinds::Off.host());
    }

    #[test]
    fn a_bad_value_is_refused_naming_every_accepted_one() {
        for bad in [TraceKinds::parse("gpu").unwrap_err(), rejected("3")] {
            let Error::InvalidArgument(message) = bad else { panic!("an invalid argument") };
            for name in ["True or False", "\"cuda\"", "\"host\"", "\"all\""] {
                assert!(message.contains(name), "{message}");
            }
        }
        assert!(TraceKinds::parse("CUDA").is_err(), "exact names only");
    }

    #[test]
    fn a_scope_without_gpus_keeps_only_the_host_part_and_refuses_cuda() {
        use TraceKinds::*;
        assert_eq!(TraceKinds::for_scope(None, All, false), Ok(Host));
        assert_eq!(TraceKinds::for_scope(None, Host, false), Ok(Host));
        assert_eq!(TraceKinds::for_scope(None, Cuda, false), Ok(Off));
        assert_eq!(TraceKinds::for_scope(Some(Host), Off, false), Ok(Host));
        assert!(TraceKinds::for_scope(Some(Cuda), Off, false).is_err());
        assert_eq!(TraceKinds::for_scope(None, All, true), Ok(All));
        assert_eq!(TraceKinds::for_scope(Some(Off), All, true), Ok(Off), "the experiment's own choice wins");
        assert_eq!(TraceKinds::Cuda.setting(), None);
        assert_eq!(TraceKinds::All.setting(), Some("all"));
    }
}
