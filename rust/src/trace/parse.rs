//! Torch's allocation-history snapshot (`torch.cuda.memory._snapshot()`, pickled) read into typed
//! structs. Many events share a stack, so each distinct frame and stack is stored once and events
//! carry a `StackId`: a million events cost a few dozen bytes each, not a copy of their stack.

use std::cell::RefCell;
use std::collections::HashMap;

use serde::de::{Deserialize, Deserializer, IgnoredAny};

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

/// Every distinct string, frame and stack of a snapshot, stored once.
#[derive(Debug)]
pub struct Stacks {
    strings: Vec<Box<str>>,
    string_ids: HashMap<Box<str>, u32>,
    /// (filename, line, name) with the strings as ids.
    frames: Vec<(u32, u32, u32)>,
    frame_ids: HashMap<(u32, u32, u32), u32>,
    /// Stack `s` is `stack_frames[stack_starts[s]..stack_starts[s + 1]]`, innermost first.
    stack_starts: Vec<u32>,
    stack_frames: Vec<u32>,
    stack_ids: HashMap<Box<[u32]>, StackId>,
}

impl Default for Stacks {
    fn default() -> Stacks {
        let mut stacks = Stacks {
            strings: Vec::new(),
            string_ids: HashMap::new(),
            frames: Vec::new(),
            frame_ids: HashMap::new(),
            stack_starts: vec![0],
            stack_frames: Vec::new(),
            stack_ids: HashMap::new(),
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
    Snapshot,
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
            "snapshot" => Action::Snapshot,
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

/// A whole snapshot: the allocator's state at the end, each device's trace, and their stacks.
#[derive(Debug, Default)]
pub struct Snapshot {
    pub segments: Vec<Segment>,
    pub device_traces: Vec<Vec<Event>>,
    pub stacks: Stacks,
}

thread_local! {
    // The stacks being filled by the parse running on this thread: serde's derived
    // deserializers take no context, and this lets frames be interned as they are read instead
    // of every event keeping its own strings until the end.
    static INTERNER: RefCell<Option<Stacks>> = const { RefCell::new(None) };
}

impl Snapshot {
    /// Reads a pickled snapshot (protocols 2 to 5, as `pickle.dumps(torch.cuda.memory._snapshot())`,
    /// memory_viz and Mosaic write it). serde-pickle runs no code from the file.
    pub fn from_pickle(bytes: &[u8]) -> Result<Snapshot> {
        INTERNER.with(|cell| *cell.borrow_mut() = Some(Stacks::default()));
        // Read by `pickle` (torch shares frame objects between entries, which serde-pickle's own
        // reader refuses), then typed by serde.
        let raw: std::result::Result<RawSnapshot, String> =
            super::pickle::read(bytes).and_then(|value| serde_pickle::from_value(value).map_err(|e| e.to_string()));
        let stacks = INTERNER.with(|cell| cell.borrow_mut().take()).unwrap_or_default();
        let raw = raw.map_err(|error| {
            Error::InvalidArgument(format!(
                "not a torch memory snapshot ({error}); write one with \
                 pickle.dump(torch.cuda.memory._snapshot(), f)"
            ))
        })?;
        Ok(Snapshot { segments: raw.segments, device_traces: raw.device_traces, stacks })
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

fn intern_frames(frames: Vec<RawFrame>) -> StackId {
    INTERNER.with(|cell| {
        let mut slot = cell.borrow_mut();
        let stacks = slot.get_or_insert_with(Stacks::default);
        let ids: Vec<u32> =
            frames.iter().map(|frame| stacks.intern_frame(&frame.filename, frame.line, &frame.name)).collect();
        stacks.intern_stack(&ids)
    })
}

fn intern_annotation(text: &str) -> Option<u32> {
    (!text.is_empty())
        .then(|| INTERNER.with(|cell| cell.borrow_mut().get_or_insert_with(Stacks::default).intern_string(text)))
}

#[derive(serde::Deserialize, Default)]
#[serde(default)]
struct RawSnapshot {
    segments: Vec<Segment>,
    device_traces: Vec<Vec<Event>>,
}

#[derive(serde::Deserialize, Default)]
#[serde(default)]
struct RawFrame {
    filename: String,
    line: u32,
    name: String,
}

/// A stack read and interned on the spot.
#[derive(Default)]
struct Interned(StackId);

impl<'de> Deserialize<'de> for Interned {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Interned, D::Error> {
        let frames = Option::<Vec<RawFrame>>::deserialize(deserializer)?.unwrap_or_default();
        Ok(Interned(intern_frames(frames)))
    }
}

/// `user_metadata` is a string in torch; anything else there is not ours to read.
#[derive(Default)]
struct Annotation(Option<u32>);

impl<'de> Deserialize<'de> for Annotation {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Annotation, D::Error> {
        #[derive(serde::Deserialize)]
        #[serde(untagged)]
        enum Text {
            Text(String),
            Other(IgnoredAny),
        }
        Ok(Annotation(match Text::deserialize(deserializer)? {
            Text::Text(text) => intern_annotation(&text),
            Text::Other(_) => None,
        }))
    }
}

/// A number torch may write as None (an oom's address, a stream).
fn number<'de, D: Deserializer<'de>, T: Deserialize<'de> + Default>(
    deserializer: D,
) -> std::result::Result<T, D::Error> {
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

#[derive(serde::Deserialize, Default)]
#[serde(default)]
struct RawEvent {
    action: String,
    #[serde(deserialize_with = "number")]
    addr: u64,
    #[serde(deserialize_with = "number")]
    size: u64,
    #[serde(deserialize_with = "number")]
    stream: i64,
    #[serde(deserialize_with = "number")]
    time_us: i64,
    frames: Interned,
    #[serde(deserialize_with = "number")]
    device_free: u64,
    user_metadata: Annotation,
}

impl<'de> Deserialize<'de> for Event {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Event, D::Error> {
        let raw = RawEvent::deserialize(deserializer)?;
        Ok(Event {
            action: Action::named(&raw.action),
            addr: raw.addr,
            size: raw.size,
            stream: raw.stream,
            time_us: raw.time_us,
            stack: raw.frames.0,
            device_free: raw.device_free,
            annotation: raw.user_metadata.0,
        })
    }
}

#[derive(serde::Deserialize, Default)]
#[serde(default)]
struct RawBlock {
    #[serde(deserialize_with = "number")]
    address: u64,
    #[serde(deserialize_with = "number")]
    size: u64,
    #[serde(deserialize_with = "number")]
    requested_size: u64,
    state: String,
    frames: Interned,
}

impl<'de> Deserialize<'de> for SegmentBlock {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<SegmentBlock, D::Error> {
        let raw = RawBlock::deserialize(deserializer)?;
        let state = match raw.state.as_str() {
            "active_allocated" => BlockState::ActiveAllocated,
            "active_pending_free" => BlockState::ActivePendingFree,
            _ => BlockState::Inactive,
        };
        Ok(SegmentBlock {
            address: raw.address,
            size: raw.size,
            requested_size: raw.requested_size,
            state,
            stack: raw.frames.0,
        })
    }
}

#[derive(serde::Deserialize, Default)]
#[serde(default)]
struct RawSegment {
    #[serde(deserialize_with = "number")]
    device: usize,
    #[serde(deserialize_with = "number")]
    address: u64,
    #[serde(deserialize_with = "number")]
    total_size: u64,
    #[serde(deserialize_with = "number")]
    stream: i64,
    segment_type: Option<String>,
    blocks: Vec<SegmentBlock>,
}

impl<'de> Deserialize<'de> for Segment {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Segment, D::Error> {
        let raw = RawSegment::deserialize(deserializer)?;
        Ok(Segment {
            device: raw.device,
            address: raw.address,
            total_size: raw.total_size,
            stream: raw.stream,
            segment_type: raw.segment_type.unwrap_or_default(),
            blocks: raw.blocks,
        })
    }
}
