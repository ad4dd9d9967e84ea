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

use super::{Attached, Closing, Finishing, Identities, Kind, Opening, Owner, Registry, SafePoint, ScopeId};
use crate::monitor::Sample;
use crate::report::{Details, Params, Report};
use crate::snapshot::{GpuSelection, Snapshot};
use crate::teardown::Teardown;
use crate::trace::TraceKinds;

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
    /// Every experiment opened inside it and still open finishes first, innermost first.
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
}

/// An experiment opened.
pub struct Opened {
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

/// Opens an experiment: the steps of [`OPEN`]. A step that fails skips the rest, but the held
/// interrupts are given back and what already finished is published.
pub fn open<W: World>(world: &mut W, request: Request) -> Result<Opened, W::Error> {
    let owner = request.owner;
    let kinds = TraceKinds::for_scope(request.trace, world.registry().trace_by_default, request.gpu)?;
    let mut to_publish = Vec::new();
    let mut replaced = Vec::new();
    let mut failed = None;
    let mut interrupted = false;
    let mut held = world.new_held();
    let mut selection = GpuSelection::None;
    let mut trace_notes = Vec::new();
    let mut rank_note = None;
    let mut start = None;
    let mut opened = None;
    for step in OPEN {
        if failed.is_some() && !matches!(step, OpenStep::ReleaseInterrupts | OpenStep::Publish) {
            continue;
        }
        let done = match step {
            OpenStep::PreparePublishing => world.prepare_publishing(),
            OpenStep::HoldInterrupts => {
                world.hold_interrupts();
                Ok(())
            }
            OpenStep::FinishUnreachable => {
                finish_due(world, SafePoint::Opening, &mut to_publish).map(|reports| replaced.extend(reports))
            }
            OpenStep::FinishReplaced => {
                let ids =
                    world.registry().replaced_by(request.name.as_deref(), &request.handles, &request.on_stack, owner);
                ids.into_iter().try_for_each(|id| {
                    let keep = request.in_use.clone();
                    replaced.extend(finish_one(world, id, keep, false, &mut to_publish)?);
                    Ok(())
                })
            }
            OpenStep::SelectDevices => {
                // On a node of 8, the other seven would be idle rows in every rank's report.
                let own = if request.gpu && request.devices.is_none() { world.own_gpu() } else { None };
                if let Some((index, because)) = &own {
                    rank_note = Some(format!("a rank: covers cuda:{index} only, {because}; devices= names others"));
                }
                selection = match (request.gpu, request.devices.clone().or(own.map(|(index, _)| vec![index]))) {
                    (false, _) => GpuSelection::None,
                    (true, None) => GpuSelection::AllVisible,
                    (true, Some(devices)) => GpuSelection::Only(devices),
                };
                match &selection {
                    GpuSelection::Only(wanted) => world.check_devices(wanted),
                    _ => Ok(()),
                }
            }
            OpenStep::StartTrace => {
                if kinds.cuda() {
                    trace_notes.extend(world.start_trace(&mut held));
                }
                Ok(())
            }
            OpenStep::TakeInventory if request.in_namespace => world.take_inventory(&mut held),
            OpenStep::Pin if request.in_namespace => world.pin(&mut held),
            OpenStep::TakeInventory | OpenStep::Pin => Ok(()),
            OpenStep::ApplyLimit => match request.limit {
                Some(limit) => world.apply_limit(&mut held, &selection, limit),
                None => Ok(()),
            },
            OpenStep::StartMonitor => match request.monitor_s {
                Some(seconds) => crate::units::interval_of_seconds(seconds)
                    .map_err(W::Error::from)
                    .and_then(|interval| world.start_monitor(&mut held, interval, request.gpu)),
                None => Ok(()),
            },
            OpenStep::StartHostTrace => {
                if kinds.host() {
                    trace_notes.extend(world.start_host_trace(&mut held));
                }
                Ok(())
            }
            OpenStep::StartSnapshot => {
                let mut snapshot = world.start_snapshot(&selection);
                snapshot.notes.append(&mut trace_notes);
                snapshot.notes.extend(rank_note.take());
                start = Some(snapshot);
                Ok(())
            }
            OpenStep::Register => {
                let start = start.as_ref().expect("StartSnapshot comes before Register");
                let mut registry = world.registry();
                let name = registry.name_or_default(request.name.clone());
                let title = format!("{name} · started");
                let id = registry.open(Opening {
                    name,
                    kind: if request.gpu { Kind::Gpu } else { Kind::Cpu },
                    selection: selection.clone(),
                    start: start.clone(),
                    cell_log: request.cell_log,
                    limit: request.limit,
                    handles: request.handles.clone(),
                    params: request.params.clone(),
                    owner,
                });
                registry.attach(id, Attached::new(std::mem::take(&mut held)));
                opened = Some((id, title));
                Ok(())
            }
            OpenStep::ResetCounters => {
                world.reset_counters(start.as_ref().expect("StartSnapshot comes before ResetCounters"));
                Ok(())
            }
            OpenStep::ArmRecorder => {
                world.arm_recorder();
                Ok(())
            }
            OpenStep::ReleaseInterrupts => {
                interrupted = world.release_interrupts();
                Ok(())
            }
            OpenStep::Publish => {
                let amended = publish(world, &to_publish);
                replaced = with_notes(std::mem::take(&mut replaced), &amended);
                Ok(())
            }
        };
        if let Err(error) = done {
            failed.get_or_insert(error);
        }
    }
    if let Some(error) = failed {
        return Err(error);
    }
    let (id, title) = opened.expect("Register is a step of every opening");
    Ok(Opened { id, start: start.expect("StartSnapshot is a step of every opening"), title, replaced, interrupted })
}

/// Finishes an experiment, and first every experiment opened inside it, with interrupts held
/// throughout. `during_reset`: IPython's `%reset` is clearing the namespace and would fail on a
/// name deleted under it, so the teardown leaves every name to the reset.
pub fn finish<W: World>(
    world: &mut W,
    id: ScopeId,
    keep: BTreeSet<String>,
    during_reset: bool,
) -> Result<Finished, W::Error> {
    held_then_published(world, |world, to_publish| finish_one(world, id, keep, during_reset, to_publish))
}

/// Finishes the experiments found unreachable whose teardown may run `at` this point.
pub fn finish_unreachable<W: World>(world: &mut W, at: SafePoint) -> Result<Finished, W::Error> {
    held_then_published(world, |world, to_publish| finish_due(world, at, to_publish))
}

/// Runs `work` with interrupts held, then publishes what it finished (a store may wait, and
/// only gpuexp's own bookkeeping runs with interrupts held), whether or not it failed.
fn held_then_published<W: World>(
    world: &mut W,
    work: impl FnOnce(&mut W, &mut Vec<ScopeId>) -> Result<Vec<Arc<Report>>, W::Error>,
) -> Result<Finished, W::Error> {
    world.hold_interrupts();
    let mut to_publish = Vec::new();
    let finished = work(world, &mut to_publish);
    let interrupted = world.release_interrupts();
    let amended = publish(world, &to_publish);
    Ok(Finished { reports: with_notes(finished?, &amended), interrupted })
}

/// The teardowns due `at` this point. A teardown's own `gc.collect()` may find another
/// experiment unreachable: it is due here too. One that waits behind a scope opened inside it
/// gets one collection first, since that scope may be garbage the collector has not found yet.
/// Each round finishes every scope it took (a finished one leaves the open scopes) or stops at
/// an error.
fn finish_due<W: World>(
    world: &mut W,
    at: SafePoint,
    to_publish: &mut Vec<ScopeId>,
) -> Result<Vec<Arc<Report>>, W::Error> {
    let mut finished = Vec::new();
    let mut collected = false;
    loop {
        let due = world.registry().due(at);
        if due.is_empty() {
            if collected || !world.registry().unreachable_waiting() {
                return Ok(finished);
            }
            world.collect_garbage()?;
            collected = true;
        }
        for id in due {
            finished.extend(finish_one(world, id, BTreeSet::new(), false, to_publish)?);
        }
    }
}

/// The steps of [`FINISH`] for one experiment. Returns the reports of the experiments it
/// finished, innermost first (empty when its teardown is already under way). `to_publish` gets
/// the experiments whose teardown this call completed.
fn finish_one<W: World>(
    world: &mut W,
    id: ScopeId,
    keep: BTreeSet<String>,
    during_reset: bool,
    to_publish: &mut Vec<ScopeId>,
) -> Result<Vec<Arc<Report>>, W::Error> {
    let mut finished = Vec::new();
    let mut keep = Some(keep);
    let mut closing: Option<Closing> = None;
    let mut held = W::Held::default();
    let mut before = None;
    let mut done = None;
    let mut details = Details::default();
    let mut report = None;
    for step in FINISH {
        match step {
            FinishStep::FinishInner => {
                let inner = world.registry().inner_of(id);
                for inner_id in inner {
                    let keep = keep.clone().unwrap_or_default();
                    finished.extend(finish_one(world, inner_id, keep, during_reset, to_publish)?);
                }
            }
            FinishStep::AddKeep => {
                if let Some(scope) = world.registry().scope_mut(id) {
                    scope.keep.extend(keep.take().unwrap_or_default());
                }
            }
            FinishStep::KeepWhatCameAfter => keep_what_came_after(world, id)?,
            FinishStep::BeginFinish => match world.registry().begin_finish(id) {
                Finishing::Finished(report) => return Ok(vec![report]),
                Finishing::InProgress => return Ok(finished),
                Finishing::Unknown => return Err(W::unknown(id)),
                Finishing::Ready(ready) => {
                    held = ready.attached.take().unwrap_or_default();
                    closing = Some(Closing { attached: Attached::default(), ..ready });
                }
            },
            FinishStep::BeforeSnapshot => {
                let snapshot = world.snapshot(&closing.as_ref().expect("begun").selection);
                world.registry().peaks.observe(&snapshot);
                before = Some(snapshot);
            }
            FinishStep::FinishHostTrace => world.finish_host_trace(&mut held),
            FinishStep::Teardown => {
                let Closing { selection, keep, .. } = closing.as_ref().expect("begun");
                let teardown = world.teardown(&mut held, selection, keep, !during_reset);
                details.names = teardown.names;
                details.notes = teardown.notes;
                if during_reset {
                    details.notes.push(
                        "finished by %reset: the reset deletes names itself, so gpuexp deleted none and lists none \
                         (what the reset keeps stays)"
                            .into(),
                    );
                }
                details.notes.extend(world.inventory_notes(&held));
                done = Some(teardown.end);
            }
            FinishStep::RestoreLimit => {
                if let Err(e) = world.restore_limit(&mut held) {
                    details.notes.push(format!("restoring torch's memory fraction failed: {e}"));
                }
            }
            FinishStep::StopMonitor => details.monitor = world.stop_monitor(&mut held),
            FinishStep::BuildReport => {
                let registry = world.registry();
                let scope = registry.scope(id).expect("a closing scope stays open until Record");
                let (before, end) = (before.as_ref().expect("measured"), done.as_ref());
                report = Some(registry.report_of(scope, before, end, std::mem::take(&mut details)));
            }
            FinishStep::HuntLeaks => {
                let report = report.as_mut().expect("built");
                if let Err(e) = world.hunt_leaks(&mut held, report) {
                    report.notes.push(format!("the leak hunt failed: {e}"));
                }
            }
            FinishStep::DropPins => world.drop_pins(&mut held),
            FinishStep::CompleteTrace => world.complete_trace(&mut held, report.as_mut().expect("built")),
            FinishStep::CompleteHostTrace => world.complete_host_trace(&mut held, report.as_mut().expect("built")),
            FinishStep::CompleteRanks => world.complete_ranks(report.as_mut().expect("built")),
            FinishStep::Record => {
                let report = report.take().expect("built");
                finished.push(world.registry().complete(id, report));
                to_publish.push(id);
            }
            FinishStep::UpdateSampler => world.update_sampler(),
            FinishStep::SettleRecording => world.settle_recording(),
        }
    }
    Ok(finished)
}

/// Before the teardown of a scope found unreachable: the names bound since one of the user's
/// names last led to it are kept, and its report says why (judged now, against the user's names
/// as they are).
fn keep_what_came_after<W: World>(world: &mut W, id: ScopeId) -> Result<(), W::Error> {
    if world.registry().scope(id).is_none_or(|s| s.unreachable.is_none()) {
        return Ok(());
    }
    let now = world.identities(id)?;
    let mut registry = world.registry();
    if let Some((kept, note)) = registry.kept_when_unreachable(id, &now) {
        if let Some(scope) = registry.scope_mut(id) {
            scope.keep.extend(kept);
            scope.notes.push(note);
        }
    }
    Ok(())
}

/// Publishes the reports a teardown completed, in a rank. What a store's failure adds to a
/// report is kept in the history; returns each report so amended, after its version before.
fn publish<W: World>(world: &mut W, ids: &[ScopeId]) -> Vec<(Arc<Report>, Arc<Report>)> {
    let mut amended = Vec::new();
    for &id in ids {
        let Some(report) = world.registry().report(id) else { continue };
        let notes = world.publish(id, &report);
        if let Some(with_notes) = world.registry().add_notes(id, notes) {
            amended.push((report, with_notes));
        }
    }
    amended
}

/// The reports to hand back, each in its version with the notes publishing added.
fn with_notes(reports: Vec<Arc<Report>>, amended: &[(Arc<Report>, Arc<Report>)]) -> Vec<Arc<Report>> {
    let latest = |r: Arc<Report>| match amended.iter().find(|(before, _)| Arc::ptr_eq(before, &r)) {
        Some((_, after)) => after.clone(),
        None => r,
    };
    reports.into_iter().map(latest).collect()
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
