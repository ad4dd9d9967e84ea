//! An experiment's opening: the steps of [`OPEN`] in order, over [`World`].

use super::finishing::{finish_due, finish_one, publish, with_notes, Names};
use super::lifecycle::{OpenStep, OpenedScope, Request, World, OPEN};
use super::{Attached, Kind, Opening, SafePoint};
use crate::snapshot::GpuSelection;
use crate::trace::TraceKinds;

/// Opens an experiment: the steps of [`OPEN`]. A step that fails skips the rest, but the held
/// interrupts are given back and what already finished is published.
pub fn open<W: World>(world: &mut W, request: Request) -> Result<OpenedScope, W::Error> {
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
                    replaced.extend(finish_one(world, id, keep, &Names::Judged, &mut to_publish)?);
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
                registry.opened_by(id, request.owner_identity, request.on_main_thread);
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
    Ok(OpenedScope {
        id,
        start: start.expect("StartSnapshot is a step of every opening"),
        title,
        replaced,
        interrupted,
    })
}
