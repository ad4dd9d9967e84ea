//! An experiment's finishing, and first that of every experiment opened inside it: the steps of
//! [`FINISH`] in order, over [`World`], with the reports published after.

use std::collections::BTreeSet;
use std::sync::Arc;

use super::lifecycle::{FinishStep, Finished, World, FINISH};
use super::{Attached, Closing, Finishing, SafePoint, ScopeId};
use crate::report::{Details, Report};

/// Finishes an experiment, and first every experiment opened inside it, with interrupts held
/// throughout. `during_reset`: IPython's `%reset` is clearing the namespace and would fail on a
/// name deleted under it, so the teardown leaves every name to the reset.
pub fn finish<W: World>(
    world: &mut W,
    id: ScopeId,
    keep: BTreeSet<String>,
    during_reset: bool,
) -> Result<Finished, W::Error> {
    let names = if during_reset { Names::LeftToReset } else { Names::Judged };
    held_then_published(world, |world, to_publish| finish_one(world, id, keep, &names, to_publish))
}

/// Finishes an experiment whose opening `cut_by` (an interrupt) stopped before its object was
/// bound to any name: what the cell binds after it (the `k` of `except KeyboardInterrupt as
/// k`) is not the experiment's, so the teardown deletes no name, and the report says why.
pub fn finish_cut_opening<W: World>(world: &mut W, id: ScopeId, cut_by: &str) -> Result<Finished, W::Error> {
    let names = Names::OpeningCut(cut_by.to_string());
    held_then_published(world, |world, to_publish| finish_one(world, id, BTreeSet::new(), &names, to_publish))
}

/// What a finish may do with the user's names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Names {
    /// What the experiment created or rebound goes, but what it keeps.
    Judged,
    /// IPython's `%reset` is clearing the namespace and would fail on a name deleted under it.
    LeftToReset,
    /// Its opening was cut short by this error.
    OpeningCut(String),
}

impl Names {
    fn note(&self) -> Option<String> {
        match self {
            Names::Judged => None,
            Names::LeftToReset => Some(
                "finished by %reset: the reset deletes names itself, so gpuexp deleted none and lists none \
                 (what the reset keeps stays)"
                    .into(),
            ),
            Names::OpeningCut(error) => Some(format!(
                "its opening was interrupted ({error}) before the experiment was bound to a name: it finished at \
                 once and deleted nothing"
            )),
        }
    }
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
pub(super) fn finish_due<W: World>(
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
            finished.extend(finish_one(world, id, BTreeSet::new(), &Names::Judged, to_publish)?);
        }
    }
}

/// The steps of [`FINISH`] for one experiment. Returns the reports of the experiments it
/// finished, innermost first (empty when its teardown is already under way). `to_publish` gets
/// the experiments whose teardown this call completed.
pub(super) fn finish_one<W: World>(
    world: &mut W,
    id: ScopeId,
    keep: BTreeSet<String>,
    names: &Names,
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
                for inner_id in inner.finish {
                    let keep = keep.clone().unwrap_or_default();
                    finished.extend(finish_one(world, inner_id, keep, names, to_publish)?);
                }
                // A running one stays open; what was bound while it ran is its code's.
                for running in inner.running {
                    let bound = super::running::bound_while_running(world.names_since_opening(running)?);
                    keep.get_or_insert_with(BTreeSet::new).extend(bound);
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
                let teardown = world.teardown(&mut held, selection, keep, *names == Names::Judged);
                details.names = teardown.names;
                details.notes = teardown.notes;
                details.notes.extend(names.note());
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
pub(super) fn publish<W: World>(world: &mut W, ids: &[ScopeId]) -> Vec<(Arc<Report>, Arc<Report>)> {
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
pub(super) fn with_notes(reports: Vec<Arc<Report>>, amended: &[(Arc<Report>, Arc<Report>)]) -> Vec<Arc<Report>> {
    let latest = |r: Arc<Report>| match amended.iter().find(|(before, _)| Arc::ptr_eq(before, &r)) {
        Some((_, after)) => after.clone(),
        None => r,
    };
    reports.into_iter().map(latest).collect()
}
