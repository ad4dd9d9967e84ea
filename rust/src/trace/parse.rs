//! Torch's allocation-history snapshot (`torch.cuda.memory._snapshot()`, pickled) read into typed
//! structs; unknown keys are ignored and missing ones read as 0 or empty. Many events share a stack, so each distinct frame and stack is stored once and events
//! carry a `StackId`: a million events cost a few dozen bytes each, not a copy of their stack.

use std::collections::HashMap;

use super::marks::{Recorded, StepMark};
use super::pickle::{self, Finish, Value};
use crate::error::{Error, Result};

/// Which stack an event or block was recorded with: an index into `Stacks`. Stack 0 is the
/// empty one (no Python frame).
pub type StackId = u32;

/// One Python frame, borrowed from the snapshot's string table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameRef<'a> {
    /// The filename's id in the snapshot's string table.
    pub file: u32,
    pub filename: &'a str,
    pub line: u32,
    pub name: &'a str,
}

/// Every distinct string, frame and stack of a snapshot, stored once. The maps are keyed by
/// what the file holds, so they hash with a per-process random seed: a file can't aim at
/// collisions it can't compute.
#[derive(Debug)]
pub struct Stacks {
    strings: Vec<Box<str>>,
    string_ids: HashMap<Box<str>, u32>,
    /// (filename, line, name) with the strings as ids.
    frames: Vec<(u32, u32, u32)>,
    frame_ids: foldhash::HashMap<(u32, u32, u32), u32>,
    /// Stack `s` is `stack_frames[stack_starts[s]..stack_starts[s + 1]]`, innermost first.
    stack_starts: Vec<u32>,
    stack_frames: Vec<u32>,
    stack_ids: foldhash::HashMap<Box<[u32]>, StackId>,
}

impl Default for Stacks {
    fn default() -> Stacks {
        let mut stacks = Stacks {
            strings: Vec::new(),
            string_ids: HashMap::new(),
            frames: Vec::new(),
            frame_ids: HashMap::default(),
            stack_starts: vec![0],
            stack_frames: Vec::new(),
            stack_ids: HashMap::default(),
        };
        stacks.intern_stack(&[]);
        stacks
    }
}

impl Stacks {
    pub fn intern_string(&mut self, text: &str) -> u32 {
        if let Some(&id) = self.string_ids.get(text) {
            return id;
        }
        let id = self.strings.len() as u32;
        self.strings.push(text.into());
        self.string_ids.insert(text.into(), id);
        id
    }

    pub fn string(&self, id: u32) -> &str {
        &self.strings[id as usize]
    }

    pub fn intern_frame(&mut self, filename: &str, line: u32, name: &str) -> u32 {
        let key = (self.intern_string(filename), line, self.intern_string(name));
        let next = self.frames.len() as u32;
        *self.frame_ids.entry(key).or_insert_with(|| {
            self.frames.push(key);
            next
        })
    }

    /// The filename of the frame `frame` (an id from [`Stacks::intern_frame`]).
    pub fn frame_filename(&self, frame: u32) -> &str {
        self.string(self.frames[frame as usize].0)
    }

    /// The id of the stack made of these frames (innermost first), stored once.
    pub fn intern_stack(&mut self, frames: &[u32]) -> StackId {
        if let Some(&id) = self.stack_ids.get(frames) {
            return id;
        }
        let id = (self.stack_starts.len() - 1) as StackId;
        self.stack_frames.extend_from_slice(frames);
        self.stack_starts.push(self.stack_frames.len() as u32);
        self.stack_ids.insert(frames.into(), id);
        id
    }

    /// The frames of `stack`, innermost first.
    pub fn frames(&self, stack: StackId) -> impl Iterator<Item = FrameRef<'_>> + '_ {
        let (start, end) = (self.stack_starts[stack as usize], self.stack_starts[stack as usize + 1]);
        self.stack_frames[start as usize..end as usize].iter().map(|&frame| {
            let (filename, line, name) = self.frames[frame as usize];
            FrameRef { file: filename, filename: self.string(filename), line, name: self.string(name) }
        })
    }

    /// The stack has no frame.
    pub fn is_bare(&self, stack: StackId) -> bool {
        self.frames(stack).next().is_none()
    }

    /// How many distinct stacks the snapshot holds.
    pub fn count(&self) -> usize {
        self.stack_starts.len() - 1
    }
}

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
        let invalid = |why: String| {
            Error::InvalidArgument(format!(
                "not a torch memory snapshot ({why}); write one with \
                 pickle.dump(torch.cuda.memory._snapshot(), f)"
            ))
        };
        let mut builder = Builder::new(keep_going, bytes.len());
        let read = pickle::read(bytes, &mut builder);
        if let Some(stopped) = builder.stopped.take() {
            return Err(stopped);
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
            let why = format!(
                "its entries refer to one another so that reading it would build more than {} events, \
                 blocks and frames from a file of {} bytes, which no snapshot torch writes does",
                builder.budget.limit,
                bytes.len()
            );
            return Err(invalid(why));
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

/// What a file of `n` bytes may have the builder make or visit, in items (an event copied, a
/// block, a frame of a stack, an entry of a dict read): a pickle refers back to what it made
/// in a few bytes, so 80 KB of references to references would otherwise build 22 GB of
/// events. Torch's own files take a few items per byte at most (an event is some 100 bytes).
const ITEMS_PER_BYTE: usize = 16;
/// And whatever the file's size: a small file is never refused for its size.
const ITEMS_AT_LEAST: usize = 1 << 20;

/// Items left to the builder; once spent, it builds nothing more and the read is refused.
#[derive(Debug, Default)]
struct Budget {
    limit: usize,
    left: usize,
}

impl Budget {
    fn of(bytes: usize) -> Budget {
        let limit = bytes.saturating_mul(ITEMS_PER_BYTE).saturating_add(ITEMS_AT_LEAST);
        Budget { limit, left: limit }
    }

    /// Takes `items` from what is left: false (and nothing taken) when that is too few.
    fn charge(&mut self, items: usize) -> bool {
        match self.left.checked_sub(items) {
            Some(left) => {
                self.left = left;
                true
            }
            None => {
                self.left = 0;
                false
            }
        }
    }

    fn spent(&self) -> bool {
        self.left == 0
    }
}

/// The largest size a block, a segment or a request can have: no device holds a PiB, so a
/// larger one (or a negative one, or one past 64 bits) is nonsense, not a fact to show.
pub const MAX_SIZE: u64 = 1 << 50;

/// Turns each event dict into an `Event` as soon as the reader appends it to its trace, and
/// interns frames: a shared frame dict is read once (its id noted on it).
struct Builder<'a> {
    stacks: Stacks,
    events: Vec<Event>,
    scratch: Vec<u32>,
    budget: Budget,
    keep_going: &'a mut dyn FnMut() -> Result<()>,
    /// Why the read stopped, when `keep_going` said so.
    stopped: Option<Error>,
    /// The first impossible size met: its field, value and where it is.
    impossible: Option<String>,
}

fn int(value: &Value, key: &str) -> i64 {
    value.get(key).and_then(|v| v.as_int()).unwrap_or(0)
}

/// A size as the file gives it; None for one no device could hold (see `MAX_SIZE`), shown.
fn size(value: &Value) -> std::result::Result<u64, String> {
    match value {
        Value::Int(n) if (0..=MAX_SIZE as i64).contains(n) => Ok(*n as u64),
        Value::Int(n) => Err(n.to_string()),
        Value::Opaque => Err("a number past 64 bits".into()),
        _ => Ok(0),
    }
}

impl<'a> Builder<'a> {
    fn new(keep_going: &'a mut dyn FnMut() -> Result<()>, file_bytes: usize) -> Builder<'a> {
        Builder {
            budget: Budget::of(file_bytes),
            stacks: Stacks::default(),
            events: Vec::new(),
            scratch: Vec::new(),
            keep_going,
            stopped: None,
            impossible: None,
        }
    }

    /// The size in `value`, or 0 with the first impossible one noted (`field` of `what`).
    fn size(&mut self, value: &Value, field: &str, what: impl FnOnce() -> String) -> u64 {
        size(value).unwrap_or_else(|shown| {
            self.impossible.get_or_insert_with(|| format!("{field} {shown} in {}", what()));
            0
        })
    }

    fn frame(&mut self, frame: &Value) -> u32 {
        if let Value::Dict(dict) = frame {
            if let Some(id) = dict.note.get() {
                return id;
            }
        }
        if !self.budget.charge(frame.item_count()) {
            return 0;
        }
        let (mut filename, mut line, mut name) = (None, 0, None);
        frame.for_each_entry(|key, value| match key {
            "filename" => filename = value.as_str().map(str::to_string),
            "line" => line = value.as_int().unwrap_or(0).clamp(0, u32::MAX as i64) as u32,
            "name" => name = value.as_str().map(str::to_string),
            _ => {}
        });
        let id = self.stacks.intern_frame(filename.as_deref().unwrap_or(""), line, name.as_deref().unwrap_or(""));
        if let Value::Dict(dict) = frame {
            dict.note.set(Some(id));
        }
        id
    }

    /// A frames list's stack (the list read already, as `finish_list` does, or now).
    fn stack(&mut self, frames: Option<&Value>) -> StackId {
        if let Some(stack) = frames.and_then(Value::read_list) {
            return stack;
        }
        if !self.budget.charge(frames.map_or(0, Value::item_count)) {
            return 0;
        }
        match frames {
            Some(Value::List(list)) => self.stack_of(list.borrow().iter()),
            Some(other) => self.stack_of(other.items().iter()),
            None => self.stack_of(std::iter::empty()),
        }
    }

    fn stack_of<'v>(&mut self, frames: impl Iterator<Item = &'v Value>) -> StackId {
        if self.budget.spent() {
            return 0;
        }
        let mut ids = std::mem::take(&mut self.scratch);
        ids.clear();
        ids.extend(frames.map(|frame| self.frame(frame)));
        let stack = self.stacks.intern_stack(&ids);
        self.scratch = ids;
        stack
    }

    /// A trace's events, whether read as they were made or now.
    fn trace(&mut self, trace: &Value) -> Vec<Event> {
        let mut events = Vec::new();
        if !self.budget.charge(trace.item_count()) {
            return events;
        }
        for item in trace.items() {
            let items = match &item {
                Value::Kept { count, .. } => *count as usize,
                other => 1 + other.item_count(),
            };
            if !self.budget.charge(items) {
                return events;
            }
            if let Value::Kept { first, count } = item {
                events.extend_from_slice(&self.events[first as usize..][..count as usize]);
            } else if let Some(index) = item.read_dict() {
                events.push(self.events[index as usize]);
            } else if let Value::Dict(dict) = &item {
                let event = self.event(dict.borrow().iter().map(|(key, value)| (key, value)), &mut Vec::new());
                events.push(event);
            }
        }
        events
    }

    /// `trace` is every event kept, in order (one run of them).
    fn holds_every_event(&self, trace: &Value) -> bool {
        let Value::List(list) = trace else { return false };
        let items = list.borrow();
        let count = self.events.len() as u32;
        match items.as_slice() {
            [] => count == 0,
            [Value::Kept { first: 0, count: all }] => *all == count,
            _ => false,
        }
    }

    /// Reads an event into `events`.
    fn keep<'v>(&mut self, entries: impl Iterator<Item = (&'v Value, &'v Value)>, read: &mut Vec<(Value, u32)>) -> u32 {
        let event = self.event(entries, read);
        self.events.push(event);
        (self.events.len() - 1) as u32
    }

    /// One pass over the event's entries (events are most of a snapshot); its frames list, if
    /// not read yet (an empty one, or one of 1000 frames or more), goes in `read` as its stack:
    /// complete by now, it need not be kept as a list (torch makes a new empty one per event).
    fn event<'v>(
        &mut self,
        entries: impl Iterator<Item = (&'v Value, &'v Value)>,
        read: &mut Vec<(Value, u32)>,
    ) -> Event {
        let mut event = Event {
            action: Action::Other,
            addr: 0,
            size: 0,
            stream: 0,
            time_us: 0,
            stack: 0,
            device_free: 0,
            annotation: None,
        };
        let mut frames = None;
        let mut annotation = None;
        let mut impossible = None;
        let number = |value: &Value| value.as_int().unwrap_or(0);
        let mut sized = |value: &Value, field: &'static str| {
            size(value).unwrap_or_else(|shown| {
                impossible.get_or_insert((field, shown));
                0
            })
        };
        let entries = entries.filter_map(|(key, value)| Some((key.as_str()?, value)));
        entries.for_each(|(key, value)| match key {
            "action" => event.action = Action::named(value.as_str().unwrap_or("")),
            "addr" => event.addr = number(value) as u64,
            "size" => event.size = sized(value, "size"),
            "stream" => event.stream = number(value),
            "time_us" => event.time_us = number(value),
            "device_free" => event.device_free = sized(value, "device_free"),
            "frames" => frames = Some(value),
            "user_metadata" => annotation = value.as_str().filter(|text| !text.is_empty()).map(str::to_string),
            _ => {}
        });
        if let Some((field, shown)) = impossible {
            let at = self.events.len();
            self.impossible.get_or_insert_with(|| {
                format!("{field} {shown} in event {at} of the file ({:?} at address {:#x})", event.action, event.addr)
            });
        }
        event.stack = self.stack(frames);
        if let Some(list @ Value::List(_)) = frames.filter(|frames| frames.read_list().is_none()) {
            read.push((list.clone(), event.stack));
        }
        event.annotation = annotation.map(|text| self.stacks.intern_string(&text));
        event
    }

    /// The `gpuexp` key (see `opening`); what is missing or malformed reads as absent.
    fn gpuexp(&mut self, key: &Value) -> Gpuexp {
        let cap =
            |value: &Value| value.get("max_entries").and_then(|m| m.as_int()).and_then(|m| usize::try_from(m).ok());
        let opening = key.get("opening").filter(|o| matches!(o, Value::Dict(_))).map(|opening| Opening {
            time_us: int(&opening, "time_us"),
            max_entries: cap(&opening),
            segments: opening
                .get("segments")
                .map(|s| s.items())
                .unwrap_or_default()
                .iter()
                .map_while(|s| self.segment(s))
                .collect(),
        });
        let window = key.get("window").filter(|w| matches!(w, Value::Dict(_))).map(|window| Window {
            opened_us: int(&window, "opened_us"),
            max_entries: cap(&window),
            peaks: (window.get("peaks").map(|p| p.items()).unwrap_or_default().iter())
                .map(|peak| (int(peak, "device").max(0) as usize, int(peak, "max_memory_allocated").max(0) as u64))
                .collect(),
        });
        let steps = key.get("steps").filter(|s| matches!(s, Value::List(_))).map(|steps| {
            (steps.items().iter())
                .filter_map(|mark| {
                    let recorded = Recorded::parse(mark.get("recorded")?.as_str()?)?;
                    Some(StepMark { time_us: int(mark, "time_us"), recorded })
                })
                .collect()
        });
        Gpuexp { opening, window, steps }
    }

    /// A segment and its blocks, none once the budget is spent.
    fn segment(&mut self, dict: &Value) -> Option<Segment> {
        if !self.budget.charge(1 + dict.item_count()) {
            return None;
        }
        let blocks = dict.get("blocks").unwrap_or(Value::None);
        let blocks = if self.budget.charge(blocks.item_count()) { blocks.items() } else { Vec::new() };
        let segment_type = dict.get("segment_type");
        let address = int(dict, "address") as u64;
        let segment = move || format!("the segment at address {address:#x}");
        let total_size = dict.get("total_size").map_or(0, |found| self.size(&found, "total_size", segment));
        Some(Segment {
            device: int(dict, "device").max(0) as usize,
            address,
            total_size,
            stream: int(dict, "stream"),
            segment_type: segment_type.as_ref().and_then(Value::as_str).unwrap_or("").to_string(),
            blocks: blocks.iter().map_while(|block| self.block(block, &segment)).collect(),
        })
    }

    /// A segment's block, none once the budget is spent.
    fn block(&mut self, block: &Value, segment: &dyn Fn() -> String) -> Option<SegmentBlock> {
        if !self.budget.charge(1 + block.item_count()) {
            return None;
        }
        let at = int(block, "address") as u64;
        let what = || format!("the block at address {at:#x} of {}", segment());
        let size = block.get("size").map_or(0, |found| self.size(&found, "size", what));
        let requested_size = block.get("requested_size").map_or(0, |found| self.size(&found, "requested_size", what));
        let state = block.get("state");
        Some(SegmentBlock {
            address: at,
            size,
            requested_size,
            state: match state.as_ref().and_then(Value::as_str) {
                Some("active_allocated") => BlockState::ActiveAllocated,
                Some("active_pending_free") => BlockState::ActivePendingFree,
                _ => BlockState::Inactive,
            },
            stack: self.stack(block.get("frames").as_ref()),
        })
    }
}

impl Finish for Builder<'_> {
    /// An event dict appended to a list and not read yet (see `finish_dict`) becomes an `Event`.
    fn finish(&mut self, item: Value, read: &mut Vec<(Value, u32)>) -> Value {
        let Value::Dict(dict) = &item else { return item };
        let starts_with_action = dict.borrow().first().is_some_and(|(key, _)| key.as_str() == Some("action"));
        if !starts_with_action || !self.budget.charge(dict.borrow().len()) {
            return item;
        }
        let first = self.keep(dict.borrow().iter().map(|(key, value)| (key, value)), read);
        Value::Kept { first, count: 1 }
    }

    /// An event is read as its dict is made. Torch writes `action` first; a dict that does not
    /// start with it (a frame, a block) is stored as it is, and an event written otherwise is
    /// still read, when appended or at the end.
    fn finish_dict(&mut self, items: &[Value], read: &mut Vec<(Value, u32)>) -> Option<u32> {
        if items.first().and_then(Value::as_str) != Some("action") || !self.budget.charge(items.len() / 2) {
            return None;
        }
        Some(self.keep(items.chunks_exact(2).map(|pair| (&pair[0], &pair[1])), read))
    }

    /// A frames list (every item a frame dict: one read already, or one with a `filename`) is
    /// read as its stack as it is made, never stored.
    fn keep_going(&mut self) -> std::result::Result<(), pickle::Error> {
        (self.keep_going)().map_err(|stopped| {
            let why = stopped.to_string();
            self.stopped = Some(stopped);
            why
        })
    }

    fn finish_list(&mut self, items: &[Value]) -> Option<u32> {
        for item in items {
            let Value::Dict(dict) = item else { return None };
            if dict.note.get().is_none() {
                let entries = dict.borrow();
                if !self.budget.charge(entries.len())
                    || !entries.iter().any(|(key, _)| key.as_str() == Some("filename"))
                {
                    return None;
                }
            }
        }
        Some(self.stack_of(items.iter()))
    }
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
            &include_bytes!("testdata/snapshot_shared_frames_p0.pickle")[..],
            include_bytes!("testdata/snapshot_shared_frames_p4.pickle"),
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
