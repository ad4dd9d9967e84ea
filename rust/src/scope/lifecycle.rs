//! An experiment's life in order: its opening, its finishing (and first that of every
//! experiment opened inside it), and the publishing of its report across ranks. [`open`],
//! [`finish`] and [`finish_unreachable`] run the steps of [`OPEN`] and [`FINISH`] in that order
//! and make every decision between them; what the steps act on (Python, torch, the user's
//! namespace, a rank's store) comes in through [`World`], which the bindings implement over
//! Python and the tests over a fake that records its calls. The bindings' handles of an open
//! experiment (`World::Held`) live in its one record in the registry (see [`super::Attached`]).

use std::collections::BTreeSet;
use std::sync::{Arc, MutexGuard};
use std::time::Duration;

use super::{Identities, Owner, Registry, ScopeId};
use crate::monitor::Sample;
use crate::report::{Details, Params, Report};
use crate::snapshot::{GpuSelection, Snapshot};
use crate::teardown::{NameState, Teardown};
use crate::trace::TraceKinds;

pub use super::finishing::{finish, finish_cut_opening, finish_unreachable};
pub use super::opening::open;

/// The steps of an opening, in the order they run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpenStep {
    /// Before interrupts are held: opening a rank's store may wait on the network or a disk.
    PreparePublishing,
    /// From here to [`OpenStep::ReleaseInterrupts`], Ctrl-C waits: an opening never stops halfway.
    HoldInterrupts,
    /// Outside a notebook, the experiments found unreachable since the last safe point go first.
    FinishUnreachable,
    /// The experiments this one replaces (same name, or bound to a name the constructor's cell
    /// binds again) finish, keeping the names the cell binds above the constructor.
    FinishReplaced,
    /// A rank covers its own GPU unless `devices=` names others.
    SelectDevices,
    /// Before the start snapshot: a trace may initialise CUDA, whose context is no scope's doing.
    StartTrace,
    /// Tensor storages and arrays reachable now: a leak hunt at finish names only what came after.
    TakeInventory,
    /// Pins are made before the start snapshot so their own memory is not charged to the scope.
    Pin,
    ApplyLimit,
    StartMonitor,
    /// After the pins and the inventory: gpuexp's own objects are not the experiment's growth.
    StartHostTrace,
    StartSnapshot,
    Register,
    /// Just after the start snapshot, which the peak windows already open have folded in.
    ResetCounters,
    ArmRecorder,
    ReleaseInterrupts,
    /// The reports of the experiments replaced, sent to the rank's store once interrupts are
    /// given back: a store may wait.
    Publish,
}

pub const OPEN: [OpenStep; 17] = [
    OpenStep::PreparePublishing,
    OpenStep::HoldInterrupts,
    OpenStep::FinishUnreachable,
    OpenStep::FinishReplaced,
    OpenStep::SelectDevices,
    OpenStep::StartTrace,
    OpenStep::TakeInventory,
    OpenStep::Pin,
    OpenStep::ApplyLimit,
    OpenStep::StartMonitor,
    OpenStep::StartHostTrace,
    OpenStep::StartSnapshot,
    OpenStep::Register,
    OpenStep::ResetCounters,
    OpenStep::ArmRecorder,
    OpenStep::ReleaseInterrupts,
    OpenStep::Publish,
];

/// The steps of one experiment's finishing, in the order they run (interrupts are held by the
/// caller around all of it, and the reports published after).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishStep {
    /// Every experiment opened inside it and still open finishes first, innermost first, but
    /// those whose `with` block still runs: they stay open, and it keeps the names they bound.
    FinishInner,
    AddKeep,
    /// One found unreachable keeps the names bound since one of the user's names last led to it.
    KeepWhatCameAfter,
    /// Marks it closing, or stops: finished already (its report), or under way further up.
    BeginFinish,
    BeforeSnapshot,
    /// Before the teardown: what the experiment's code made and still held, not what it leaked.
    FinishHostTrace,
    Teardown,
    RestoreLimit,
    StopMonitor,
    BuildReport,
    /// Names what still holds memory the scope created. Runs Python code: the registry is not held.
    HuntLeaks,
    /// The pins into the user's namespace go before the trace is read.
    DropPins,
    CompleteTrace,
    CompleteHostTrace,
    CompleteRanks,
    Record,
    UpdateSampler,
    /// The cell log this scope kept on may have held a share of the recording.
    SettleRecording,
}

pub const FINISH: [FinishStep; 18] = [
    FinishStep::FinishInner,
    FinishStep::AddKeep,
    FinishStep::KeepWhatCameAfter,
    FinishStep::BeginFinish,
    FinishStep::BeforeSnapshot,
    FinishStep::FinishHostTrace,
    FinishStep::Teardown,
    FinishStep::RestoreLimit,
    FinishStep::StopMonitor,
    FinishStep::BuildReport,
    FinishStep::HuntLeaks,
    FinishStep::DropPins,
    FinishStep::CompleteTrace,
    FinishStep::CompleteHostTrace,
    FinishStep::CompleteRanks,
    FinishStep::Record,
    FinishStep::UpdateSampler,
    FinishStep::SettleRecording,
];

/// What an experiment's life acts on. `held` is the bindings' own record of one experiment,
/// filled by the opening's steps and emptied by the finishing's.
pub trait World {
    /// The bindings' handles of an open experiment (its pins, its monitor, its trace windows).
    type Held: Default + Send + 'static;
    type Error: From<crate::error::Error> + std::fmt::Display;

    /// Never held by the runner while it calls another of these methods: they run Python code,
    /// which may call back in.
    fn registry(&self) -> MutexGuard<'_, Registry>;
    /// The error for an id no experiment had.
    fn unknown(id: ScopeId) -> Self::Error;
    /// An experiment's handles before its opening's steps fill them in.
    fn new_held(&mut self) -> Self::Held;

    fn hold_interrupts(&mut self);
    /// Gives the held interrupts back; returns whether one came meanwhile (false if none was held).
    fn release_interrupts(&mut self) -> bool;

    // ---- opening ----
    fn prepare_publishing(&mut self) -> Result<(), Self::Error>;
    /// This process's GPU where it is a rank of a process group, and why, in words.
    fn own_gpu(&mut self) -> Option<(u32, String)>;
    fn check_devices(&mut self, wanted: &[u32]) -> Result<(), Self::Error>;
    /// Returns what the report's start should say of it.
    fn start_trace(&mut self, held: &mut Self::Held) -> Vec<String>;
    fn take_inventory(&mut self, held: &mut Self::Held) -> Result<(), Self::Error>;
    fn pin(&mut self, held: &mut Self::Held) -> Result<(), Self::Error>;
    fn apply_limit(&mut self, held: &mut Self::Held, selection: &GpuSelection, limit: u64) -> Result<(), Self::Error>;
    fn start_monitor(&mut self, held: &mut Self::Held, interval: Duration, gpus: bool) -> Result<(), Self::Error>;
    fn start_host_trace(&mut self, held: &mut Self::Held) -> Vec<String>;
    /// Where memory stands, the sampler brought up to cover it first.
    fn start_snapshot(&mut self, selection: &GpuSelection) -> Snapshot;
    fn reset_counters(&mut self, start: &Snapshot);
    fn arm_recorder(&mut self);

    // ---- finishing ----
    /// Lets the cycle collector find experiments that wait for one opened inside them.
    fn collect_garbage(&mut self) -> Result<(), Self::Error>;
    /// The user's names now, for an experiment found unreachable (none outside a namespace).
    fn identities(&mut self, id: ScopeId) -> Result<Identities, Self::Error>;
    /// The user's names, each judged against what it held when experiment `id` opened (none
    /// outside a namespace).
    fn names_since_opening(&mut self, id: ScopeId) -> Result<Vec<NameState>, Self::Error>;
    fn snapshot(&mut self, selection: &GpuSelection) -> Snapshot;
    fn finish_host_trace(&mut self, held: &mut Self::Held);
    /// The core's teardown; `names`: whether it may act on the user's names at all.
    fn teardown(
        &mut self,
        held: &mut Self::Held,
        selection: &GpuSelection,
        keep: &BTreeSet<String>,
        names: bool,
    ) -> Teardown;
    /// What the opening's inventory could not inspect.
    fn inventory_notes(&self, held: &Self::Held) -> Vec<String>;
    fn restore_limit(&mut self, held: &mut Self::Held) -> Result<(), Self::Error>;
    /// Its samples, the monitor stopped; none without one.
    fn stop_monitor(&mut self, held: &mut Self::Held) -> Vec<Sample>;
    fn hunt_leaks(&mut self, held: &mut Self::Held, report: &mut Report) -> Result<(), Self::Error>;
    fn drop_pins(&mut self, held: &mut Self::Held);
    fn complete_trace(&mut self, held: &mut Self::Held, report: &mut Report);
    fn complete_host_trace(&mut self, held: &mut Self::Held, report: &mut Report);
    fn complete_ranks(&mut self, report: &mut Report);
    fn update_sampler(&mut self);
    fn settle_recording(&mut self);

    // ---- publishing ----
    /// Sends a finished report to the rank's store; returns what its failure adds to the report.
    fn publish(&mut self, id: ScopeId, report: &Report) -> Vec<String>;
}

/// What an experiment opens with, its arguments checked and converted.
#[derive(Clone, Debug)]
pub struct Request {
    pub name: Option<String>,
    pub gpu: bool,
    pub devices: Option<Vec<u32>>,
    /// In a namespace it may delete from (false: a function body in a script, or `delete=False`:
    /// it only measures).
    pub in_namespace: bool,
    pub cell_log: bool,
    pub limit: Option<u64>,
    pub monitor_s: Option<f64>,
    /// The names the constructor's cell binds the experiment to.
    pub handles: BTreeSet<String>,
    /// Names the constructor's cell binds above the constructor: the experiments it replaces keep them.
    pub in_use: BTreeSet<String>,
    /// The open experiments whose code is still running: never replaced by name.
    pub on_stack: BTreeSet<ScopeId>,
    pub params: Option<Params>,
    pub trace: Option<TraceKinds>,
    pub owner: Owner,
    /// The experiment object's identity (CPython's `id`): only it finishes the scope. None
    /// where no object owns it (a tool's measurement).
    pub owner_identity: Option<u64>,
    /// Whether it opens on the main thread.
    pub on_main_thread: bool,
}

/// An experiment opened.
pub struct OpenedScope {
    pub id: ScopeId,
    pub start: Snapshot,
    pub title: String,
    /// The reports of the experiments it replaced, innermost first.
    pub replaced: Vec<Arc<Report>>,
    /// Whether an interrupt came while it opened: the caller raises it once it is shown.
    pub interrupted: bool,
}

/// Reports of experiments finished, innermost first, and whether an interrupt came meanwhile.
pub struct Finished {
    pub reports: Vec<Arc<Report>>,
    pub interrupted: bool,
}

/// The report of a scope as it stands: final once finished, else live (measured now); None
/// for an id no scope had.
pub fn report_now<W: World>(world: &mut W, id: ScopeId) -> Option<Arc<Report>> {
    let selection = {
        let registry = world.registry();
        if let Some(done) = registry.report(id) {
            return Some(done);
        }
        registry.scope(id)?.selection.clone()
    };
    let now = world.snapshot(&selection);
    let mut registry = world.registry();
    registry.peaks.observe(&now);
    let scope = registry.scope(id)?;
    Some(Arc::new(registry.report_of(scope, &now, None, Details::default())))
}

/// In a forked child: the parent's experiments are not the child's. The registry starts anew,
/// and the parent's records, handles included, are forgotten, never dropped: their monitors'
/// threads don't exist here, and their pins refer into the parent's namespace (dropping them
/// would run Python code with the registry held).
pub fn forget_in_child(registry: &mut Registry) {
    std::mem::forget(std::mem::take(registry));
}
