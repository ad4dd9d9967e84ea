//! Where a block was allocated: the innermost frame in the user's own code (a notebook cell's
//! line, a `file:line` of theirs), or, for a block with no such frame, the phase it was made in.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

use serde::{Serialize, Serializer};

use super::block::Block;
use super::block::SiteSource;
use super::parse::{FrameRef, StackId, Stacks};
use super::replay::Replay;
use crate::estimate::Category;

/// Which frames are the user's: any whose filename does not contain one of `skip`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SiteRule {
    pub skip: Vec<String>,
}

impl Default for SiteRule {
    /// Torch, installed packages, the standard library, frozen modules, and gpuexp itself.
    fn default() -> SiteRule {
        SiteRule {
            skip: ["/torch/", "site-packages/", "dist-packages/", "<frozen", "/lib/python3", "/gpuexp/"]
                .map(String::from)
                .to_vec(),
        }
    }
}

impl SiteRule {
    /// `skip` plus more fragments (the bindings add gpuexp's and the standard library's real paths).
    pub fn with(mut self, fragments: impl IntoIterator<Item = String>) -> SiteRule {
        self.skip.extend(fragments);
        self
    }

    /// A filename longer than any path (`LONGEST_PATH`) names no file of torch or a library:
    /// it is the file's own, and is not searched (it may be megabytes long).
    pub fn is_user(&self, filename: &str) -> bool {
        if filename.len() > LONGEST_PATH {
            return true;
        }
        let normal = filename.replace('\\', "/");
        !filename.is_empty() && !self.skip.iter().any(|fragment| normal.contains(fragment.as_str()))
    }

    /// The innermost frame of `stack` in the user's code.
    pub fn user_frame<'a>(&self, stacks: &'a Stacks, stack: StackId) -> Option<FrameRef<'a>> {
        stacks.frames(stack).find(|frame| self.is_user(frame.filename))
    }
}

/// How a (filename, line) reads in a report. The bindings implement it with IPython's cell
/// names and linecache; `PlainNamer` serves tests and snapshot files.
pub trait SiteNamer {
    /// `In [12], line 4`, or `train.py:41`.
    fn label(&self, filename: &str, line: u32) -> String;
    /// The line's source, trimmed: `scores = q @ k.transpose(-2, -1)`.
    fn source(&self, filename: &str, line: u32) -> Option<String>;

    /// The label and the source of a line of a file's string: the label made from the clipped
    /// name, the source asked for only where the name can be a path. A file's string may be
    /// megabytes long and shared by thousands of sites, and each ask copies and hashes it.
    fn named(&self, filename: &str, line: u32) -> (String, Option<String>) {
        let source = (filename.len() <= LONGEST_PATH).then(|| self.source(filename, line)).flatten();
        (self.label(&clipped(filename), line), source)
    }
}

/// The longest path the kernel opens (Linux's PATH_MAX): a longer filename names no file, so
/// it has no source to read.
pub const LONGEST_PATH: usize = 4096;

/// `file:line` with the line read from the file when it is there (each file read once).
#[derive(Default)]
pub struct PlainNamer {
    files: RefCell<HashMap<String, Option<Vec<String>>>>,
}

impl SiteNamer for PlainNamer {
    fn label(&self, filename: &str, line: u32) -> String {
        format!("{filename}:{line}")
    }

    fn source(&self, filename: &str, line: u32) -> Option<String> {
        let mut files = self.files.borrow_mut();
        let lines = files.entry(filename.to_string()).or_insert_with(|| {
            std::fs::read_to_string(filename).ok().map(|text| text.lines().map(str::to_string).collect())
        });
        let text = lines.as_ref()?.get((line as usize).checked_sub(1)?)?.trim();
        (!text.is_empty()).then(|| text.to_string())
    }
}

/// Which part of a training step an allocation without a user frame was made in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Forward,
    Backward,
    OptimizerStep,
}

impl Phase {
    /// The phase a stack shows: autograd's backward or an optimizer's step anywhere in it.
    /// Frames say nothing of the forward pass, so anything else is `Forward`.
    pub fn of(stacks: &Stacks, stack: StackId) -> Phase {
        Phase::of_frames(
            stacks.frames(stack).map(|frame| (Strings::of_file(frame.filename), Strings::of_name(frame.name))),
        )
    }

    /// `of`, with what each frame's filename and name tell found already.
    fn of_frames(frames: impl Iterator<Item = (Strings, Strings)>) -> Phase {
        for (file, name) in frames {
            if name.backward || file.autograd {
                return Phase::Backward;
            }
            // Not any `step`: a user's training step is one too.
            if file.optim || name.optimizer {
                return Phase::OptimizerStep;
            }
        }
        Phase::Forward
    }

    pub fn label(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::OptimizerStep => "optimizer step",
        }
    }
}

/// What a frame's filename or function name tells the attribution, found once per distinct
/// string: a file's string may be megabytes long and shared by every frame.
#[derive(Clone, Copy, Debug, Default)]
struct Strings {
    user: bool,
    autograd: bool,
    optim: bool,
    init: bool,
    module_py: bool,
    backward: bool,
    optimizer: bool,
    parameter_method: bool,
}

impl Strings {
    fn of_file(filename: &str) -> Strings {
        let file = filename.replace('\\', "/");
        Strings {
            autograd: file.contains("torch/autograd/"),
            optim: file.contains("/optim/"),
            init: file.contains("torch/nn/init.py"),
            module_py: file.contains("torch/nn/modules/module.py"),
            ..Strings::default()
        }
    }

    fn of_name(name: &str) -> Strings {
        Strings {
            backward: name.contains("backward"),
            optimizer: name.contains("optimizer"),
            parameter_method: ["_apply", "to", "cuda"].contains(&name),
            ..Strings::default()
        }
    }
}

/// What a block's site is, by identity (strings are the snapshot's interned ids; `module` is a
/// family in the replay's `Modules`, where gpuexp's hooks marked one).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SiteKey {
    /// A line of the user's code, within a module's forward where one was marked: a model
    /// from a library allocates on the user's `model(x)` line, and its modules tell the rows apart.
    Line { filename: u32, line: u32, module: Option<u32> },
    /// No user frame: the phase, the module (`backward of model.layers.*.attn`), and the user's
    /// line that started it when one is known (`opt.step()` at In [7], line 5).
    Phase { phase: Phase, from: Option<(u32, u32)>, module: Option<u32> },
    /// Allocated before recording began and freed in it: nothing is known of where.
    BeforeRecording,
    /// Made in a step recorded without stacks, with no sampled step's block to map it to.
    Unattributed,
    /// No frame at all and no phase to go by.
    NoFrame,
}

/// A site as a report shows it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Site {
    pub label: String,
    /// The line's source, when the namer could read it.
    pub source: Option<String>,
    /// The first block's full stack, innermost first: `file:line in name`.
    pub stack: StackText,
}

/// A stack as a report shows it, innermost first (`file:line in name`): formatted once per
/// stack and shared by every row and held block that shows it, each string clipped to
/// `CLIPPED` and the whole to `STACK_TEXT`, so that a file's long string referred to by a
/// thousand frames is never a thousand copies.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StackText(Arc<[String]>);

impl std::ops::Deref for StackText {
    type Target = [String];
    fn deref(&self) -> &[String] {
        &self.0
    }
}

impl Serialize for StackText {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.0.iter())
    }
}

impl From<Vec<String>> for StackText {
    fn from(lines: Vec<String>) -> StackText {
        StackText(lines.into())
    }
}

impl FromIterator<String> for StackText {
    fn from_iter<I: IntoIterator<Item = String>>(lines: I) -> StackText {
        StackText(lines.into_iter().collect())
    }
}

/// The longest filename or function name a site shows whole (a real path is seldom half as
/// long); a longer one shows its start and end around an ellipsis.
const CLIPPED: usize = 1024;
/// The most text a stack shows; the frames past it are counted in a last line.
const STACK_TEXT: usize = 256 << 10;
/// The most text all the stacks of one attribution show together: a file's distinct stacks,
/// each of frames sharing long strings, would otherwise make far more text than the file's
/// bytes. Past it a stack shows only its count of frames.
const STACK_TEXTS: usize = 64 << 20;

/// `text`, or its start and end around `…` when longer than `CLIPPED` bytes.
pub fn clipped(text: &str) -> std::borrow::Cow<'_, str> {
    if text.len() <= CLIPPED {
        return text.into();
    }
    let head = text.floor_char_boundary(CLIPPED / 2);
    let tail = text.ceil_char_boundary(text.len() - CLIPPED / 2);
    format!("{}…({} bytes)…{}", &text[..head], text.len() - head - (text.len() - tail), &text[tail..]).into()
}

/// Blocks to sites, with the rule, the namer and the snapshot's strings. What a stack tells (its
/// user line, its phase) is found once per stack: a large trace has millions of blocks and few
/// thousand stacks.
pub struct Attribution<'a> {
    pub stacks: &'a Stacks,
    pub rule: &'a SiteRule,
    pub namer: &'a dyn SiteNamer,
    line_keys: RefCell<HashMap<StackId, Option<(u32, u32)>>>,
    phases: RefCell<HashMap<StackId, Phase>>,
    parameter_stacks: RefCell<HashMap<StackId, bool>>,
    stack_texts: RefCell<HashMap<StackId, StackText>>,
    /// What is left of `STACK_TEXTS`.
    stack_text_left: std::cell::Cell<usize>,
    /// What each filename and name tells, by its id: user code, autograd, an optimizer.
    strings: RefCell<HashMap<(u32, bool), Strings>>,
}

impl<'a> Attribution<'a> {
    pub fn new(stacks: &'a Stacks, rule: &'a SiteRule, namer: &'a dyn SiteNamer) -> Attribution<'a> {
        Attribution {
            stacks,
            rule,
            namer,
            line_keys: RefCell::default(),
            phases: RefCell::default(),
            parameter_stacks: RefCell::default(),
            stack_texts: RefCell::default(),
            stack_text_left: STACK_TEXTS.into(),
            strings: RefCell::default(),
        }
    }

    /// What a filename (`file`) or function name tells, looked at once per string.
    fn strings(&self, id: u32, file: bool) -> Strings {
        *self.strings.borrow_mut().entry((id, file)).or_insert_with(|| {
            let text = self.stacks.string(id);
            match file {
                // No path, and no function name of torch's, is that long: neither is searched.
                _ if text.len() > LONGEST_PATH => Strings { user: file, ..Strings::default() },
                true => Strings { user: self.rule.is_user(text), ..Strings::of_file(text) },
                false => Strings::of_name(text),
            }
        })
    }

    /// What each frame of `stack` tells: its filename's and its name's.
    fn frame_strings(&self, stack: StackId) -> impl Iterator<Item = (FrameRef<'a>, Strings, Strings)> + '_ {
        self.stacks
            .frames(stack)
            .map(|frame| (frame, self.strings(frame.file, true), self.strings(frame.name_id, false)))
    }

    fn line_key(&self, stack: StackId) -> Option<(u32, u32)> {
        *self.line_keys.borrow_mut().entry(stack).or_insert_with(|| {
            let (frame, _, _) = self.frame_strings(stack).find(|(_, file, _)| file.user)?;
            Some((frame.file, frame.line))
        })
    }

    fn phase(&self, stack: StackId) -> Phase {
        *self
            .phases
            .borrow_mut()
            .entry(stack)
            .or_insert_with(|| Phase::of_frames(self.frame_strings(stack).map(|(_, file, name)| (file, name))))
    }

    /// A block's phase: backward where the hooks marked it so, else what its `context` shows.
    fn block_phase(&self, replay: &Replay, block: &Block, context: StackId) -> Phase {
        match block.module {
            Some(module) if replay.modules.family(module).backward => Phase::Backward,
            _ => self.phase(context),
        }
    }

    /// The site of `block` in `replay`.
    pub fn key(&self, replay: &Replay, block: &Block) -> SiteKey {
        if block.sites == SiteSource::Unattributed {
            return SiteKey::Unattributed;
        }
        if let Some((filename, line)) = self.line_key(block.stack) {
            return SiteKey::Line { filename, line, module: block.module };
        }
        // Without its own user frame, a block goes by the stack it was made under: its own
        // (torch's frames inside opt.step()), else the last one recorded before it (autograd's
        // engine thread records none).
        let context = match block.alloc_event {
            Some(_) if !self.stacks.is_bare(block.stack) => block.stack,
            Some(event) => replay.context[event],
            None if self.stacks.is_bare(block.stack) => return SiteKey::BeforeRecording,
            None => block.stack,
        };
        if self.stacks.is_bare(context) {
            return SiteKey::NoFrame;
        }
        let phase = self.block_phase(replay, block, context);
        SiteKey::Phase { phase, from: self.line_key(context), module: block.module }
    }

    /// `stack` as a report shows it, formatted the first time it is asked for.
    pub fn stack_text(&self, stack: StackId) -> StackText {
        let mut texts = self.stack_texts.borrow_mut();
        let text = texts.entry(stack).or_insert_with(|| {
            let (mut lines, mut length, mut frames) = (Vec::new(), 0, 0);
            for frame in self.stacks.frames(stack) {
                frames += 1;
                if length < STACK_TEXT.min(self.stack_text_left.get()) {
                    let line = format!("{}:{} in {}", clipped(frame.filename), frame.line, clipped(frame.name));
                    length += line.len();
                    lines.push(line);
                }
            }
            self.stack_text_left.set(self.stack_text_left.get().saturating_sub(length));
            if frames > lines.len() {
                lines.push(format!("… {} more frames", frames - lines.len()));
            }
            lines.into()
        });
        text.clone()
    }

    /// How `key` reads, without its stack: what a timeline's series needs.
    pub fn label(&self, replay: &Replay, key: SiteKey) -> (String, Option<String>) {
        let module = |id: Option<u32>| id.map(|id| replay.modules.family(id));
        match key {
            SiteKey::Line { filename, line, module: id } => {
                let (at, source) = self.namer.named(self.stacks.string(filename), line);
                let label = match module(id) {
                    Some(family) => format!("{at} in {}", family.label()),
                    None => at,
                };
                (label, source)
            }
            SiteKey::Phase { phase, from, module: id } => {
                let what = match module(id) {
                    Some(family) => format!("{} of {}", phase.label(), family.label()),
                    None => phase.label().to_string(),
                };
                let label = match from {
                    Some((filename, line)) => match self.namer.named(self.stacks.string(filename), line) {
                        (at, Some(source)) => format!("{what}, `{source}` at {at}"),
                        (at, None) => format!("{what} at {at}"),
                    },
                    None => what,
                };
                (label, None)
            }
            SiteKey::BeforeRecording => ("(allocated before recording)".to_string(), None),
            SiteKey::NoFrame => ("(no Python frame)".to_string(), None),
            SiteKey::Unattributed => ("(unattributed: made in a step recorded without stacks)".to_string(), None),
        }
    }

    /// How `key` reads; `stack` is one of its blocks' stacks.
    pub fn site(&self, replay: &Replay, key: SiteKey, stack: StackId) -> Site {
        let (label, source) = self.label(replay, key);
        Site { label, source, stack: self.stack_text(stack) }
    }

    /// What a block is to training, where the frames tell (see docs/trace.md): None for a block
    /// from before recording, or an unattributed one of a step without stacks.
    ///
    /// - made under `Module.to`/`cuda`/`_apply` or `torch/nn/init.py`: parameters;
    /// - made in an optimizer's step: optimizer state when never freed in the trace, else temporaries;
    /// - made in backward: gradients when never freed in the trace, else temporaries;
    /// - made in forward: activations when still alive at the end or freed in backward, else
    ///   temporaries.
    pub fn category(&self, replay: &Replay, block: &Block) -> Option<Category> {
        let event = block.alloc_event.filter(|_| block.sites != SiteSource::Unattributed)?;
        let context = if self.stacks.is_bare(block.stack) { replay.context[event] } else { block.stack };
        let is_parameter = *self.parameter_stacks.borrow_mut().entry(context).or_insert_with(|| {
            self.frame_strings(context).any(|(_, file, name)| file.init || (file.module_py && name.parameter_method))
        });
        if is_parameter {
            return Some(Category::Parameters);
        }
        let kept = block.free_event.is_none();
        Some(match self.block_phase(replay, block, context) {
            Phase::OptimizerStep if kept => Category::OptimizerState,
            Phase::Backward if kept => Category::Gradients,
            Phase::Forward if kept => Category::Activations,
            Phase::Forward => {
                let freed_in = self.phase(replay.context[block.free_event.expect("freed")]);
                if freed_in == Phase::Backward {
                    Category::Activations
                } else {
                    Category::Temporaries
                }
            }
            Phase::OptimizerStep | Phase::Backward => Category::Temporaries,
        })
    }
}
