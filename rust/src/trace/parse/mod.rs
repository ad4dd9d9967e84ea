//! Torch's allocation-history snapshot (`torch.cuda.memory._snapshot()`, pickled) read into typed
//! structs; unknown keys are ignored and missing ones read as 0 or empty. Many events share a
//! stack, so each distinct frame and stack is stored once and events carry a `StackId`: a
//! million events cost a few dozen bytes each, not a copy of their stack.
//!
//! - `stacks`: the strings, frames and stacks stored once;
//! - `builder`: the reader's hook that builds events and stacks as the pickle is read;
//! - `segments`: the allocator's segments and blocks; `gpuexp_key`: what gpuexp saved with them;
//! - `budget`: how much a file of its size may have the builder make;
//! - `fields`: a field's number as the file gives it, and the sizes no device could hold.

mod budget;
mod builder;
mod fields;
mod gpuexp_key;
mod segments;
mod stacks;

pub use fields::MAX_SIZE;
pub use stacks::{FrameRef, StackId, Stacks};

use super::marks::StepMark;
use super::pickle::{self, Value};
use crate::error::{Error, Result};
use builder::Builder;

/// What the allocator did, as torch names it in `action`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    Alloc,
    /// `torch.cuda.memory_allocated` drops here: the tensor is gone, though its block may stay
    /// busy until the streams that used it are done (`FreeCompleted`).
    FreeRequested,
    FreeCompleted,
    SegmentAlloc,
    SegmentFree,
    SegmentMap,
    SegmentUnmap,
    AllocationHistory,
    Oom,
    WorkspaceSnapshot,
    /// An action this reader does not know (a newer torch); kept in order, otherwise ignored.
    Other,
}

impl Action {
    fn named(name: &str) -> Action {
        match name {
            "alloc" => Action::Alloc,
            // Torch before 2.1 wrote one `free` where it now writes free_requested.
            "free_requested" | "free" => Action::FreeRequested,
            "free_completed" => Action::FreeCompleted,
            "segment_alloc" => Action::SegmentAlloc,
            "segment_free" => Action::SegmentFree,
            "segment_map" => Action::SegmentMap,
            "segment_unmap" => Action::SegmentUnmap,
            "snapshot" => Action::AllocationHistory,
            "oom" => Action::Oom,
            "workspace_snapshot" => Action::WorkspaceSnapshot,
            _ => Action::Other,
        }
    }
}

/// One entry of a device's trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    pub action: Action,
    pub addr: u64,
    /// What the caller asked for (torch records the requested size, not the block's).
    pub size: u64,
    pub stream: i64,
    pub time_us: i64,
    pub stack: StackId,
    /// For `Oom`: what CUDA had free when the allocation failed.
    pub device_free: u64,
    /// A string the program attached (`user_metadata`), interned; the phase or module path.
    pub annotation: Option<u32>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockState {
    ActiveAllocated,
    /// Freed by the program, still busy on a stream: not in `memory_allocated`.
    ActivePendingFree,
    Inactive,
}

/// A block of a segment at the time of the snapshot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentBlock {
    pub address: u64,
    /// The block's size: what `memory_allocated` counts.
    pub size: u64,
    pub requested_size: u64,
    pub state: BlockState,
    pub stack: StackId,
}

/// One cudaMalloc'd (or mapped) segment at the time of the snapshot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    pub device: usize,
    pub address: u64,
    pub total_size: u64,
    pub stream: i64,
    pub segment_type: String,
    pub blocks: Vec<SegmentBlock>,
}

/// The allocator's state when the recording began (the `gpuexp` key's `opening`: see `opening.rs`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Opening {
    /// When it was taken, in Unix microseconds (torch's `time_us` clock): just before the first event.
    pub time_us: i64,
    /// The ring buffer's cap the recording started with: a trace that long may have wrapped,
    /// and then the opening state no longer precedes its first event.
    pub max_entries: Option<usize>,
    pub segments: Vec<Segment>,
}

/// The traced experiment a saved snapshot comes from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Window {
    /// When the experiment opened (Unix microseconds): its peak is from then on.
    pub opened_us: i64,
    pub max_entries: Option<usize>,
    /// (torch index, `max_memory_allocated` over the experiment) for each GPU it traced.
    pub peaks: Vec<(usize, u64)>,
}

/// The `gpuexp` key of a snapshot: absent from torch's own files.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Gpuexp {
    pub opening: Option<Opening>,
    pub window: Option<Window>,
    /// The step marks of gpuexp's sampled stacks (see `sampled`), where gpuexp recorded the trace.
    pub steps: Option<Vec<StepMark>>,
}

/// A whole snapshot: the allocator's state at the end, each device's trace, and their stacks.
#[derive(Debug, Default)]
pub struct AllocationHistory {
    pub segments: Vec<Segment>,
    pub device_traces: Vec<Vec<Event>>,
    pub stacks: Stacks,
    /// What gpuexp saved with it to make the replay exact (absent from torch's own files).
    pub gpuexp: Gpuexp,
}

impl AllocationHistory {
    /// Reads a pickled snapshot (protocols 2 to 5, as `pickle.dumps(torch.cuda.memory._snapshot())`,
    /// memory_viz and Mosaic write it). Nothing in the file is run.
    pub fn from_pickle(bytes: &[u8]) -> Result<AllocationHistory> {
        AllocationHistory::from_pickle_checked(bytes, &mut || Ok(()))
    }

    /// `from_pickle`, asking `keep_going` every few milliseconds whether to go on: its error
    /// (`Error::Interrupted`: Ctrl-C) stops the read. A size no device could hold is refused,
    /// with its field and where it is.
    pub fn from_pickle_checked(bytes: &[u8], keep_going: &mut dyn FnMut() -> Result<()>) -> Result<AllocationHistory> {
        let invalid = not_a_snapshot;
        let mut builder = Builder::new(keep_going, bytes.len());
        let read = pickle::read(bytes, &mut builder);
        if let Some(stopped) = builder.stopped.take() {
            return Err(stopped);
        }
        let refused = |builder: &Builder| {
            invalid(format!(
                "its entries refer to one another so that reading it would build more than {} events, blocks \
                 and frames, or hold more than {}, from a file of {} bytes, which no snapshot torch writes does",
                builder.budget.limit,
                crate::units::bytes(builder.budget.held_limit as u64),
                bytes.len()
            ))
        };
        if builder.budget.spent() {
            return Err(refused(&builder));
        }
        let pickled = read.map_err(invalid)?;
        let root = &pickled.root;
        if !matches!(root, Value::Dict(_)) {
            return Err(invalid("the pickle holds no dict".into()));
        }
        let traces = root.get("device_traces").unwrap_or(Value::None);
        builder.budget.charge(traces.item_count());
        let traces = traces.items();
        // The trace made of every event the hook kept, in order (one device's: the usual case)
        // takes them as they are, so the largest thing read is never copied.
        let whole = traces.iter().rposition(|trace| builder.holds_every_event(trace));
        let device_traces = (traces.iter().enumerate())
            .map(|(i, trace)| if Some(i) == whole { std::mem::take(&mut builder.events) } else { builder.trace(trace) })
            .collect();
        let segments = root.get("segments").unwrap_or(Value::None);
        builder.budget.charge(segments.item_count());
        let segments = segments.items().iter().map_while(|segment| builder.segment(segment)).collect();
        let gpuexp = root.get("gpuexp").map(|key| builder.gpuexp(&key)).unwrap_or_default();
        if builder.budget.spent() {
            return Err(refused(&builder));
        }
        if let Some(impossible) = builder.impossible {
            return Err(Error::InvalidArgument(format!(
                "this snapshot holds an impossible size: {impossible}. No GPU holds more than {} in one block; \
                 the file was not written by torch, or was damaged",
                crate::units::bytes(MAX_SIZE)
            )));
        }
        Ok(AllocationHistory { segments, device_traces, stacks: builder.stacks, gpuexp })
    }

    /// Refuses a file whose first bytes are no pickle (see `pickle::check_start`): a large
    /// file of something else is never read whole.
    pub fn check_start(start: &[u8]) -> Result<()> {
        pickle::check_start(start).map_err(not_a_snapshot)
    }

    /// The devices that have a trace or a segment.
    pub fn devices(&self) -> Vec<usize> {
        let mut devices: Vec<usize> =
            (0..self.device_traces.len()).filter(|&d| !self.device_traces[d].is_empty()).collect();
        devices.extend(self.segments.iter().map(|segment| segment.device));
        devices.sort_unstable();
        devices.dedup();
        devices
    }
}

fn not_a_snapshot(why: String) -> Error {
    Error::InvalidArgument(format!(
        "not a torch memory snapshot ({why}); write one with pickle.dump(torch.cuda.memory._snapshot(), f)"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames(snapshot: &AllocationHistory, stack: StackId) -> Vec<(&str, u32, &str)> {
        snapshot.stacks.frames(stack).map(|frame| (frame.filename, frame.line, frame.name)).collect()
    }

    #[test]
    fn frames_lists_shared_as_torch_shares_them_read_the_same_wherever_they_are_referred_to() {
        let torch = ("/usr/lib/python3.11/site-packages/torch/nn/functional.py", 2000, "linear");
        let mut read = Vec::new();
        for fixture in [
            &include_bytes!("../testdata/snapshot_shared_frames_p0.pickle")[..],
            include_bytes!("../testdata/snapshot_shared_frames_p4.pickle"),
        ] {
            let snapshot = AllocationHistory::from_pickle(fixture).unwrap();
            let events = &snapshot.device_traces[0];
            assert_eq!(events.len(), 1506);
            let (alloc, free_requested, free_completed) = (events[0], events[1501], events[1502]);
            assert_eq!(frames(&snapshot, alloc.stack), [torch, ("/home/u/train.py", 14, "forward")]);
            assert_eq!(free_completed.stack, alloc.stack, "the list referred to again, a batch later");
            assert_eq!(snapshot.segments[0].blocks[0].stack, alloc.stack, "the block's list, read first");
            assert_eq!((free_completed.action, free_completed.addr), (Action::FreeCompleted, 1 << 30));
            assert_eq!(frames(&snapshot, free_requested.stack), [("/home/u/train.py", 30, "step")]);
            assert_eq!(events[1503], alloc, "an event dict appended twice is the same event twice");
            assert_eq!(frames(&snapshot, events[1].stack)[0], torch);
            let deep = frames(&snapshot, events[1504].stack);
            assert_eq!((deep.len(), deep[0], deep[1499]), (1500, torch, ("/home/u/train.py", 14, "forward")));
            assert_eq!((events[1505].addr, events[1505].stack), (4 << 30, 0), "no frames: the bare stack");
            let other = &snapshot.device_traces[1];
            assert_eq!((other.len(), other[0].addr, other[0].stack), (2, 5 << 30, free_requested.stack));
            assert_eq!(other[1].stack, events[1504].stack, "the long list, referred to again");
            let stacks =
                |trace: &[Event]| trace.iter().map(|e| format!("{:?}", frames(&snapshot, e.stack))).collect::<Vec<_>>();
            read.push((snapshot.device_traces.clone(), stacks(events), snapshot.segments.clone()));
        }
        assert!(read[0] == read[1], "protocol 0 (item by item) reads as protocol 4 (in batches)");
    }
}
