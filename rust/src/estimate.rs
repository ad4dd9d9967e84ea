//! What a step will need, predicted without running it on the device (`gpuexp.estimate`): the
//! ledger of every allocation the step makes under fake tensors, the peak it reaches above what
//! is allocated now, what was live at that peak, and whether that fits.

use serde::Serialize;

use crate::grid::{prefixed, Grid};
use crate::units::bytes;
use Origin::{Existing, Loaded, Made};

/// What a byte live at the peak is to training.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Category {
    Parameters,
    Buffers,
    Gradients,
    OptimizerState,
    /// Made in a forward pass and still alive when the backward pass starts (saved for it), or
    /// at the end of the step (its outputs).
    Activations,
    /// Made and freed within one part of the step: intermediates, the optimizer's scratch.
    Temporaries,
}

impl Category {
    pub const ALL: [Category; 6] = [
        Category::Parameters,
        Category::Buffers,
        Category::Gradients,
        Category::OptimizerState,
        Category::Activations,
        Category::Temporaries,
    ];

    /// The category whose [`label`](Category::label) is `label`.
    pub fn labelled(label: &str) -> Option<Category> {
        Category::ALL.into_iter().find(|c| c.label() == label)
    }

    pub fn label(self) -> &'static str {
        match self {
            Category::Parameters => "parameters",
            Category::Buffers => "buffers",
            Category::Gradients => "gradients",
            Category::OptimizerState => "optimizer state",
            Category::Activations => "activations and saved tensors",
            Category::Temporaries => "temporaries",
        }
    }

    fn what(self) -> &'static str {
        match self {
            Category::Parameters => "the model's weights",
            Category::Buffers => "module buffers (running statistics)",
            Category::Gradients => ".grad of the parameters",
            Category::OptimizerState => "e.g. Adam's exp_avg and exp_avg_sq",
            Category::Activations => "made in the forward pass, kept for backward",
            Category::Temporaries => "made and freed within forward, backward or the optimizer",
        }
    }
}

/// Which part of a step is running.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    Forward,
    Backward,
    Optimizer,
}

/// How the allocator sizes a block for a storage of `n` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rounding {
    /// Torch's CUDA caching allocator: blocks of 512-byte multiples; a request of 10 MiB or more
    /// gets a segment rounded up to 2 MiB, and keeps all of it when less than 1 MiB would be
    /// left over (too little to split off).
    CudaCaching,
    /// The host: what the storage asks for.
    Exact,
}

const MIB: u64 = 1 << 20;

impl Rounding {
    pub fn block(self, n: u64) -> u64 {
        match self {
            Rounding::Exact => n,
            Rounding::CudaCaching if n == 0 => 0,
            Rounding::CudaCaching => {
                let block = n.div_ceil(512) * 512;
                let segment = block.div_ceil(2 * MIB) * 2 * MIB;
                if n >= 10 * MIB && segment - block <= MIB {
                    segment
                } else {
                    block
                }
            }
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Origin {
    Existing(Category),
    /// Not allocated yet, but before the step (a model on the `meta` device, as loaded).
    Loaded(Category),
    Made(Phase),
}

#[derive(Clone, Copy, Debug)]
struct Record {
    bytes: u64,
    made: u64,
    freed: Option<u64>,
    origin: Origin,
    /// What a storage the step made turned out to be: a gradient, optimizer state.
    marked: Option<Category>,
}

/// A storage in the ledger.
pub type Entry = usize;

/// Every storage a step touches, in the order it made and freed them, on one clock: the peak
/// of what it allocated above the start, and what was live then.
#[derive(Debug)]
pub struct Ledger {
    rounding: Rounding,
    records: Vec<Record>,
    clock: u64,
    /// Bytes above the start: what the step made, less what it freed of what existed.
    live: i64,
    peak: i64,
    peak_at: u64,
    /// The phase running when the peak was first reached.
    peak_phase: Phase,
    phase: Phase,
    backward_starts: Vec<u64>,
    ops: u64,
}

/// What a ledger found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peak {
    /// The highest the step's allocations went above the start (0 when it only freed).
    pub above_start: u64,
    /// What was live at that moment, the tensors that existed before included.
    pub categories: Categories,
    /// Bytes of the tensors that existed before the step (parameters, gradients, buffers, state).
    pub existing: u64,
    pub ops: u64,
    /// Where in the step the peak falls: an option that changes only the optimizer's step
    /// can't move a peak outside it.
    pub phase: Phase,
}

impl Ledger {
    pub fn new(rounding: Rounding) -> Ledger {
        Ledger {
            rounding,
            records: Vec::new(),
            clock: 0,
            live: 0,
            peak: 0,
            peak_at: 0,
            peak_phase: Phase::Forward,
            phase: Phase::Forward,
            backward_starts: Vec::new(),
            ops: 0,
        }
    }

    /// A storage that exists before the step: it is in what is allocated now.
    pub fn existing(&mut self, nbytes: u64, category: Category) -> Entry {
        let bytes = self.rounding.block(nbytes);
        self.records.push(Record { bytes, made: 0, freed: None, origin: Existing(category), marked: None });
        self.records.len() - 1
    }

    /// A storage that does not exist yet and will before the step runs: a model planned on the
    /// `meta` device, as its weights will be loaded. It counts above the start from the start.
    pub fn loaded(&mut self, nbytes: u64, category: Category) -> Entry {
        let bytes = self.rounding.block(nbytes);
        self.records.push(Record { bytes, made: 0, freed: None, origin: Loaded(category), marked: None });
        self.add(bytes as i64);
        self.records.len() - 1
    }

    /// A storage the step made, in the phase running now.
    pub fn made(&mut self, nbytes: u64) -> Entry {
        let bytes = self.rounding.block(nbytes);
        self.clock += 1;
        let origin = Made(self.phase);
        self.records.push(Record { bytes, made: self.clock, freed: None, origin, marked: None });
        self.add(bytes as i64);
        self.records.len() - 1
    }

    /// A storage grew in place (`resize_`): the difference is allocated now.
    pub fn grew(&mut self, entry: Entry, nbytes: u64) {
        let bytes = self.rounding.block(nbytes);
        let before = self.records[entry].bytes;
        if bytes > before && self.records[entry].freed.is_none() {
            self.clock += 1;
            self.records[entry].bytes = bytes;
            self.add((bytes - before) as i64);
        }
    }

    pub fn freed(&mut self, entry: Entry) {
        if self.records[entry].freed.is_none() {
            self.clock += 1;
            self.records[entry].freed = Some(self.clock);
            self.live -= self.records[entry].bytes as i64;
        }
    }

    /// What a storage the step made turned out to be (a parameter's gradient, an optimizer's state).
    pub fn mark(&mut self, entry: Entry, category: Category) {
        if matches!(self.records[entry].origin, Made(_)) {
            self.records[entry].marked = Some(category);
        }
    }

    pub fn phase(&self) -> Phase {
        self.phase
    }

    pub fn enter(&mut self, phase: Phase) {
        if phase == Phase::Backward && self.phase != Phase::Backward {
            self.backward_starts.push(self.clock);
        }
        self.phase = phase;
    }

    pub fn count_op(&mut self) {
        self.ops += 1;
    }

    fn add(&mut self, bytes: i64) {
        self.live += bytes;
        if self.live > self.peak {
            self.peak = self.live;
            self.peak_at = self.clock;
            self.peak_phase = self.phase;
        }
    }

    /// What a record counts as: its mark, else what its origin and lifetime make it.
    fn category(&self, record: &Record) -> Category {
        if let Some(marked) = record.marked {
            return marked;
        }
        match record.origin {
            Existing(category) | Loaded(category) => category,
            Made(Phase::Forward) => {
                // Kept for the next backward pass, or an output the step kept to its end.
                let next_backward = self.backward_starts.iter().find(|start| **start >= record.made);
                match (record.freed, next_backward) {
                    (None, _) => Category::Activations,
                    (Some(freed), Some(start)) if freed > *start => Category::Activations,
                    _ => Category::Temporaries,
                }
            }
            Made(_) => Category::Temporaries,
        }
    }

    pub fn peak(&self) -> Peak {
        let mut categories = Categories::default();
        for record in &self.records {
            let alive_at_peak = record.made <= self.peak_at && record.freed.is_none_or(|freed| freed > self.peak_at);
            if alive_at_peak {
                *categories.get_mut(self.category(record)) += record.bytes;
            }
        }
        let existing = self.records.iter().filter(|r| matches!(r.origin, Existing(_))).map(|r| r.bytes).sum();
        Peak { above_start: self.peak.max(0) as u64, categories, existing, ops: self.ops, phase: self.peak_phase }
    }
}

/// Bytes by category, in the order a table shows them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Categories {
    pub parameters: u64,
    pub buffers: u64,
    pub gradients: u64,
    pub optimizer_state: u64,
    pub activations: u64,
    pub temporaries: u64,
}

impl Categories {
    pub fn get(&self, category: Category) -> u64 {
        let mut copy = *self;
        *copy.get_mut(category)
    }

    fn get_mut(&mut self, category: Category) -> &mut u64 {
        match category {
            Category::Parameters => &mut self.parameters,
            Category::Buffers => &mut self.buffers,
            Category::Gradients => &mut self.gradients,
            Category::OptimizerState => &mut self.optimizer_state,
            Category::Activations => &mut self.activations,
            Category::Temporaries => &mut self.temporaries,
        }
    }

    pub fn total(&self) -> u64 {
        Category::ALL.iter().map(|c| self.get(*c)).sum()
    }
}

/// What the step is checked against.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Room {
    /// "cuda:0" or "cpu".
    pub device: String,
    /// In use now: torch allocated on a GPU, the process's RSS on the host.
    pub now: u64,
    /// What more the step can have: NVML's free memory plus torch's cache, or the host's
    /// available memory; None where NVML can't be read.
    pub free: Option<u64>,
    /// What torch may allocate in all, to rehearse a smaller card (`limit=`).
    pub limit: Option<u64>,
}

/// One answer to "does it fit?".
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Fit {
    /// "free memory" or "limit".
    pub against: String,
    pub room: u64,
    pub needed: u64,
    pub fits: bool,
    /// Room left at the peak; negative when short.
    pub spare: i64,
    /// The answer in words: "fits a 24.00 GiB card: yes, 3.10 GiB to spare".
    pub answer: String,
}

impl Fit {
    fn new(against: &str, question: String, room: u64, needed: u64) -> Fit {
        let spare = room as i64 - needed as i64;
        let answer = if spare >= 0 {
            format!("{question}: yes, {} to spare", bytes(spare as u64))
        } else {
            format!("{question}: no, {} short", bytes(spare.unsigned_abs()))
        };
        Fit { against: against.into(), room, needed, fits: spare >= 0, spare, answer }
    }
}

/// The prediction for one call (or a few) of a step at one batch size.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Estimate {
    pub batch_size: u64,
    pub device: String,
    /// Calls of the step the estimate ran (a second one when the first created optimizer state).
    pub steps: u32,
    /// The predicted peak of torch allocated above what is allocated now (of RSS on the host).
    pub peak: u64,
    /// What was live at the peak, the step's tensors that exist now included.
    pub categories: Categories,
    /// Bytes of the step's parameters, gradients, buffers and optimizer state that exist now.
    pub existing: u64,
    /// The part of the step the peak falls in: forward, backward or optimizer.
    pub peak_phase: Phase,
    pub now: u64,
    pub fits: Vec<Fit>,
    /// Operators the step ran under fake tensors.
    pub ops: u64,
    pub seconds: f64,
    pub notes: Vec<String>,
}

impl Estimate {
    pub fn new(batch_size: u64, steps: u32, peak: Peak, room: &Room, seconds: f64, mut notes: Vec<String>) -> Estimate {
        let gpu = room.device != "cpu";
        let mut fits = Vec::new();
        match room.free {
            Some(free) => fits.push(Fit::new(
                "free memory",
                format!("fits the free memory of {} ({})", room.device, bytes(free)),
                free,
                peak.above_start,
            )),
            None => notes.push(format!("NVML can't be read, so {}'s free memory is unknown", room.device)),
        }
        if let Some(limit) = room.limit {
            let question = if gpu {
                format!("fits a {} card", bytes(limit))
            } else {
                format!("fits in {} of host memory", bytes(limit))
            };
            fits.push(Fit::new("limit", question, limit, room.now + peak.above_start));
        }
        Estimate {
            batch_size,
            device: room.device.clone(),
            steps,
            peak: peak.above_start,
            categories: peak.categories,
            existing: peak.existing,
            peak_phase: peak.phase,
            now: room.now,
            fits,
            ops: peak.ops,
            seconds,
            notes,
        }
    }

    pub fn grid(&self) -> Grid {
        let gpu = self.device != "cpu";
        let (held, figure) = if gpu { ("allocated", "torch allocated") } else { ("in RSS", "host RSS") };
        let calls = if self.steps == 1 { String::new() } else { format!(" × {}", self.steps) };
        let mut lines = vec![format!(
            "predicted peak: +{} {figure} above the {} {held} now ({} in all)",
            bytes(self.peak),
            bytes(self.now),
            bytes(self.now + self.peak)
        )];
        lines.push(format!(
            "{} operators ran under fake tensors in {:.2} s; nothing was allocated on the device",
            self.ops, self.seconds
        ));
        let mut rows: Vec<Vec<String>> = Category::ALL
            .iter()
            .filter(|c| self.categories.get(**c) > 0)
            .map(|c| vec![c.label().to_string(), bytes(self.categories.get(*c)), c.what().to_string()])
            .collect();
        rows.push(vec![
            "the step's tensors at the peak".into(),
            bytes(self.categories.total()),
            format!("{} of them exist now", bytes(self.existing)),
        ]);
        let mut notes: Vec<String> = self.fits.iter().map(|f| f.answer.clone()).collect();
        notes.extend(prefixed("note", &self.notes));
        Grid {
            title: format!("gpuexp · estimate · step({}){calls} on {}", self.batch_size, self.device),
            lines,
            header: ["at the peak", "size", "what"].map(String::from).to_vec(),
            rows,
            notes,
            compact: false,
        }
    }
}

#[cfg(test)]
#[path = "estimate_tests.rs"]
mod tests;
