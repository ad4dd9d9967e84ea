//! Host memory by source line for experiments opened with `trace="host"` or `"all"`: a tally of
//! tracemalloc's traces at opening (counted negative) and one at finish (before the teardown
//! deletes anything), named by `crate::trace::host`. gpuexp starts tracemalloc where it is not
//! tracing and stops it after the last experiment that needed it, since tracing slows every
//! allocation; a tracemalloc the user started is shared and left running (the recording's
//! `Lease` decides, as for torch's history). The order runs here over [`Tracemalloc`], which the
//! bindings implement over Python's module and the tests over a fake.

use crate::fork::{Guard, PerProcess};
use crate::recording_lease::{Change, Lease};
use crate::report::Report;
use crate::trace::{host_sites, HostGrowth, HostTrace, SiteNamer, SiteRule, TOP_SITES};

/// How a call into tracemalloc failed.
#[derive(Debug)]
pub enum Failure {
    /// The user's stop button (interrupts are let through while traces are read).
    Interrupted,
    Failed(String),
}

/// Python's tracemalloc, as the bindings reach it.
pub trait Tracemalloc {
    /// An object allocated at opening: its trace is gone at finish if tracemalloc was stopped since.
    type Marker;
    fn is_tracing(&self) -> Result<bool, Failure>;
    /// Starts tracing with `crate::trace::HOST_FRAMES` frames.
    fn start(&self) -> Result<(), Failure>;
    fn stop(&self) -> Result<(), Failure>;
    /// Adds `sign` times each live trace's size and count to `growth`, tracemalloc's own left out.
    fn tally_live(&self, growth: &mut HostGrowth, sign: i64) -> Result<(), Failure>;
    fn marker(&self) -> Result<Self::Marker, Failure>;
    fn traces(&self, marker: &Self::Marker) -> Result<bool, Failure>;
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        match self {
            Failure::Interrupted => write!(f, "KeyboardInterrupt"),
            Failure::Failed(e) => write!(f, "{e}"),
        }
    }
}

/// The experiments that trace the host share tracemalloc (it has one mode).
static TRACING: PerProcess<Lease<()>> = PerProcess::new(Lease::new);

fn tracing() -> Guard<'static, Lease<()>> {
    TRACING.lock()
}

/// One experiment's share of the host tracing: what was live at its opening, counted negative,
/// and its marker.
pub struct HostWindow<M> {
    start: Result<(HostGrowth, M), String>,
}

/// Joins (or starts) tracemalloc for an experiment that opens now and reads what is live;
/// returns notes for the start.
pub fn open<T: Tracemalloc>(world: &T) -> (HostWindow<T::Marker>, Vec<String>) {
    let mut notes = Vec::new();
    let start = (|| -> Result<(HostGrowth, T::Marker), Failure> {
        let mut users = false;
        let change = tracing().join((), || {
            users = world.is_tracing().unwrap_or(false);
            users
        });
        if users {
            notes.push("trace: shares the tracemalloc already tracing, and leaves it running".into());
        }
        if change == Change::Start(()) {
            if let Err(e) = world.start() {
                tracing().join_failed(());
                return Err(e);
            }
        }
        let mut live = HostGrowth::default();
        world.tally_live(&mut live, -1)?;
        Ok((live, world.marker()?))
    })();
    let start = start.map_err(|e| match e {
        Failure::Interrupted => {
            "trace: interrupted while tracemalloc's traces were read at opening, so there is no host table".into()
        }
        Failure::Failed(e) => format!("trace: tracemalloc's snapshot at opening failed ({e})"),
    });
    (HostWindow { start }, notes)
}

/// Whether the tracing that an experiment opened under still runs: tracemalloc forgets every
/// trace when stopped, so a marker without one means it was stopped since (and perhaps started
/// again, by the user's code: then that tracing is theirs).
enum Since {
    Running,
    Stopped,
    Restarted,
}

fn since<T: Tracemalloc>(world: &T, marker: &T::Marker) -> Result<Since, Failure> {
    if !world.is_tracing()? {
        return Ok(Since::Stopped);
    }
    Ok(if world.traces(marker)? { Since::Running } else { Since::Restarted })
}

/// The host's growth by site at finish, or why there is none.
pub struct HostFinding {
    trace: Option<HostTrace>,
    notes: Vec<String>,
}

impl HostFinding {
    pub fn complete_report(self, report: &mut Report) {
        report.host_trace = self.trace;
        report.notes.extend(self.notes);
    }
}

/// Reads the growth since `window` opened, before the teardown deletes anything, names its
/// sites with `namer`; the tracing ends where this was its last experiment. An interrupt while
/// the traces are read ends the reading, and the experiment finishes without the host table.
pub fn finish<T: Tracemalloc>(world: &T, window: HostWindow<T::Marker>, namer: &dyn SiteNamer) -> HostFinding {
    let mut notes = Vec::new();
    let read = window.start.and_then(|(mut growth, marker)| {
        let since = since(world, &marker).map_err(|e| format!("trace: reading tracemalloc at finish failed ({e})"))?;
        drop(marker);
        match since {
            Since::Running => {}
            Since::Stopped => {
                return Err("trace: tracemalloc was stopped during the experiment (tracemalloc.stop()), so there is \
                            no host table"
                    .into())
            }
            Since::Restarted => {
                notes.push(restarted());
                // What was live at opening was forgotten at the stop: everything live now came after it.
                growth = HostGrowth::default();
            }
        }
        match world.tally_live(&mut growth, 1) {
            Ok(()) => Ok(growth),
            Err(Failure::Interrupted) => Err("trace: interrupted while the host's allocations were compared, so \
                                              there is no host table (the rest of the experiment finished as usual)"
                .into()),
            Err(Failure::Failed(e)) => Err(format!("trace: reading tracemalloc at finish failed ({e})")),
        }
    });
    let trace = match read {
        Ok(growth) => Some(host_sites(&growth, &SiteRule::default(), namer, TOP_SITES, Vec::new())),
        Err(why) => {
            notes.push(why);
            None
        }
    };
    notes.extend(close(world));
    HostFinding { trace, notes }
}

/// A tracemalloc stopped and started again while an experiment traced is someone else's: gpuexp
/// leaves it running from then on.
fn restarted() -> String {
    tracing().disown();
    "trace: tracemalloc was stopped and started again during the experiment (by your code?): the host table \
     covers what was allocated since, and that tracing is left running"
        .into()
}

/// An experiment's share ends; the last one to leave a tracemalloc gpuexp started stops it.
fn close<T: Tracemalloc>(world: &T) -> Option<String> {
    if tracing().leave(()) != Change::Stop {
        return None;
    }
    world.stop().err().map(|e| format!("trace: tracemalloc could not be stopped ({e})"))
}

#[cfg(test)]
#[path = "host_tracing_tests.rs"]
mod tests;
