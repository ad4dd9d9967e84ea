//! `gpuexp.config`: what each setting accepts, and how a change lands on the registry. The
//! bindings convert Python's values into a [`Change`] and the figures back into a dict.

use std::time::Duration;

use super::Registry;
use crate::error::{Error, Result};
use crate::trace::TraceKinds;

/// `sample_interval_ms=` as a duration; its range is the sampler's
/// ([`crate::peak_sampler::set_interval`]).
pub fn sample_interval(ms: f64) -> Result<Duration> {
    Duration::try_from_secs_f64(ms / 1e3).map_err(|_| {
        Error::InvalidArgument(format!(
            "sample_interval_ms must be a positive number of milliseconds, e.g. gpuexp.config(sample_interval_ms=1); got {ms}"
        ))
    })
}

/// `live_view_after_s=` as given: a boolean, a number of seconds, or something else.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LiveViewAfter {
    Flag(bool),
    Seconds(f64),
    Other,
}

impl LiveViewAfter {
    /// False: no live view; seconds: how long a cell runs before it shows one. True says
    /// neither. `shown`: the value as the user wrote it, for the error.
    pub fn after(self, shown: &str) -> Result<Option<Duration>> {
        let bad = || {
            Error::InvalidArgument(format!(
                "live_view_after_s is the seconds a cell runs before its live view shows, e.g. \
                 gpuexp.config(live_view_after_s=2), or None to turn it off; got {shown}"
            ))
        };
        match self {
            LiveViewAfter::Flag(false) => Ok(None),
            LiveViewAfter::Seconds(seconds) => Duration::try_from_secs_f64(seconds).map(Some).map_err(|_| bad()),
            LiveViewAfter::Flag(true) | LiveViewAfter::Other => Err(bad()),
        }
    }
}

/// The registry's settings a `gpuexp.config` call changes; None leaves one as it is.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Change {
    pub cell_log_all_gpus: Option<bool>,
    pub oom_rescue: Option<bool>,
    pub cell_log_min_change: Option<u64>,
    pub trace: Option<TraceKinds>,
    pub flight_recorder: Option<bool>,
}

impl Change {
    /// Whether torch's CUDA allocation history, recorded for `trace`, is no longer asked for:
    /// the recording then settles at once.
    pub fn stops_cuda_trace(&self) -> bool {
        self.trace.is_some_and(|kinds| !kinds.cuda())
    }

    /// Whether the flight recorder is turned off: its recording settles at once.
    pub fn stops_flight_recorder(&self) -> bool {
        self.flight_recorder == Some(false)
    }
}

impl Registry {
    /// Applies a `gpuexp.config` change.
    pub fn configure(&mut self, change: &Change) {
        if let Some(all) = change.cell_log_all_gpus {
            self.cell_log_all_gpus = all;
        }
        if let Some(rescue) = change.oom_rescue {
            self.oom_rescue = rescue;
        }
        if let Some(min_change) = change.cell_log_min_change {
            self.cell_log_min_change = min_change;
        }
        if let Some(trace) = change.trace {
            self.trace_by_default = trace;
        }
        if let Some(on) = change.flight_recorder {
            self.flight_recorder = on;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sample_interval_is_milliseconds_and_a_bad_one_names_the_fix() {
        assert_eq!(sample_interval(250.0), Ok(Duration::from_millis(250)));
        let Err(Error::InvalidArgument(message)) = sample_interval(-1.0) else { panic!("a negative interval passed") };
        assert!(message.contains("sample_interval_ms=1") && message.ends_with("got -1"), "{message}");
        assert!(sample_interval(f64::NAN).is_err());
    }

    #[test]
    fn the_live_view_is_off_at_false_and_shows_after_seconds() {
        assert_eq!(LiveViewAfter::Flag(false).after("False"), Ok(None));
        assert_eq!(LiveViewAfter::Seconds(2.0).after("2"), Ok(Some(Duration::from_secs(2))));
        for refused in [LiveViewAfter::Flag(true), LiveViewAfter::Other, LiveViewAfter::Seconds(-1.0)] {
            let Err(Error::InvalidArgument(message)) = refused.after("True") else { panic!("{refused:?} passed") };
            assert!(message.contains("live_view_after_s=2") && message.ends_with("got True"), "{message}");
        }
    }

    #[test]
    fn a_change_sets_only_what_it_names() {
        let mut registry = Registry::default();
        let before = (registry.oom_rescue, registry.cell_log_min_change, registry.flight_recorder);
        registry.configure(&Change {
            cell_log_all_gpus: Some(true),
            trace: Some(TraceKinds::Cuda),
            ..Change::default()
        });
        assert!(registry.cell_log_all_gpus);
        assert_eq!(registry.trace_by_default, TraceKinds::Cuda);
        assert_eq!((registry.oom_rescue, registry.cell_log_min_change, registry.flight_recorder), before);
        registry.configure(&Change { oom_rescue: Some(false), cell_log_min_change: Some(7), ..Change::default() });
        assert_eq!((registry.oom_rescue, registry.cell_log_min_change), (false, 7));
    }

    #[test]
    fn turning_off_a_recording_settles_it() {
        assert!(Change { trace: Some(TraceKinds::Off), ..Change::default() }.stops_cuda_trace());
        assert!(!Change { trace: Some(TraceKinds::Cuda), ..Change::default() }.stops_cuda_trace());
        assert!(!Change::default().stops_cuda_trace());
        assert!(Change { flight_recorder: Some(false), ..Change::default() }.stops_flight_recorder());
        assert!(!Change { flight_recorder: Some(true), ..Change::default() }.stops_flight_recorder());
    }
}
