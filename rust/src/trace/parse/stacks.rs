//! A snapshot's stacks: every distinct string, frame and stack stored once, and events and blocks
//! carrying a `StackId`, so a million events cost a few dozen bytes each, not a copy of their stack.

use std::collections::HashMap;

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
    /// The function name's id in the string table.
    pub name_id: u32,
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
        let (filename, name) = (self.intern_string(filename), self.intern_string(name));
        self.intern_frame_ids(filename, line, name)
    }

    /// `intern_frame` with the strings interned already.
    pub fn intern_frame_ids(&mut self, filename: u32, line: u32, name: u32) -> u32 {
        let key = (filename, line, name);
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
            FrameRef { file: filename, filename: self.string(filename), line, name_id: name, name: self.string(name) }
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
