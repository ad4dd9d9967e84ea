//! The engine on scripted programs whose every allocation is known: the replay and the sites
//! must equal the truth to the byte, also with blocks from before recording and a wrapped buffer.

use std::collections::HashMap;

use super::*;
use crate::estimate::Category;
use crate::grid::testing::{expected_cells, html_cells, text_cells};
use crate::params::{Param, Params};

const USER: &str = "/home/u/train.py";
const TORCH: &str = "/usr/lib/python3.11/site-packages/torch/nn/functional.py";

/// A program run on a fake allocator: it writes torch's events and keeps the truth.
pub(super) struct Program {
    pub stacks: Stacks,
    pub events: Vec<Event>,
    /// addr → (block bytes, requested, stack, site label)
    live: HashMap<u64, (u64, u64, StackId, String)>,
    next_addr: u64,
    /// memory_allocated after each event, and the labels' bytes then.
    pub truth: Vec<u64>,
    by_site: Vec<HashMap<String, u64>>,
    /// Whether to keep `by_site` (a bench's million events skip it).
    pub keep_sites: bool,
    /// The memory metadata the next events carry (gpuexp's module marks).
    pub metadata: Option<u32>,
    now: u64,
    time: i64,
}

/// Torch's rounding, which the fake allocator uses for the truth.
fn block_of(requested: u64) -> u64 {
    requested.div_ceil(512).max(1) * 512
}

impl Program {
    /// Marks the next events as the hooks would (`forward 3: model.layers.0`); "" clears.
    pub fn mark(&mut self, text: &str) {
        self.metadata = (!text.is_empty()).then(|| self.stacks.intern_string(text));
    }

    pub fn new() -> Program {
        Program {
            stacks: Stacks::default(),
            events: Vec::new(),
            live: HashMap::new(),
            next_addr: 1 << 32,
            truth: Vec::new(),
            by_site: Vec::new(),
            keep_sites: true,
            metadata: None,
            now: 0,
            time: 1_000,
        }
    }

    /// A stack: torch's frame innermost, then `frames` (file, line, function), innermost first.
    pub fn stack(&mut self, frames: &[(&str, u32, &str)]) -> StackId {
        let mut ids = vec![self.stacks.intern_frame(TORCH, 2000, "linear")];
        ids.extend(frames.iter().map(|&(file, line, name)| self.stacks.intern_frame(file, line, name)));
        self.stacks.intern_stack(&ids)
    }

    /// A line of the user's code, called from the notebook.
    pub fn line(&mut self, line: u32) -> StackId {
        self.stack(&[(USER, line, "step")])
    }

    fn push(&mut self, action: Action, addr: u64, size: u64, stack: StackId) {
        self.time += 10;
        self.events.push(Event {
            action,
            addr,
            size,
            stream: 0,
            time_us: self.time,
            stack,
            device_free: 0,
            annotation: self.metadata,
        });
        self.truth.push(self.now);
        let mut sites: HashMap<String, u64> = HashMap::new();
        for (bytes, _, _, label) in self.live.values().filter(|_| self.keep_sites) {
            *sites.entry(label.clone()).or_default() += bytes;
        }
        self.by_site.push(sites);
    }

    /// Allocates `requested` bytes at `stack`, its site known as `label`.
    pub fn alloc(&mut self, requested: u64, stack: StackId, label: &str) -> u64 {
        let addr = self.next_addr;
        let bytes = block_of(requested);
        self.next_addr += bytes + 4096;
        self.now += bytes;
        self.live.insert(addr, (bytes, requested, stack, label.to_string()));
        self.push(Action::Alloc, addr, requested, stack);
        addr
    }

    /// Frees: the counter drops at free_requested; the block is done at free_completed. The
    /// frees carry no frames, as from autograd's thread or a reference dropped in C++.
    pub fn free(&mut self, addr: u64) {
        let (bytes, requested, _, _) = self.live.remove(&addr).expect("live");
        self.now -= bytes;
        self.push(Action::FreeRequested, addr, requested, 0);
        self.push(Action::FreeCompleted, addr, requested, 0);
    }

    pub fn event(&mut self, action: Action, stack: StackId) {
        self.push(action, 0, 0, stack);
    }

    /// The snapshot of the events from `start` on (the ring buffer kept only those), with the
    /// segments holding every live block; and the truth of that window.
    pub fn snapshot(&self, start: usize) -> (AllocationHistory, Vec<u64>, Vec<HashMap<String, u64>>) {
        let blocks = self
            .live
            .iter()
            .map(|(&address, &(size, requested_size, stack, _))| SegmentBlock {
                address,
                size,
                requested_size,
                state: BlockState::ActiveAllocated,
                stack,
            })
            .collect();
        let segment = Segment {
            device: 0,
            address: 1 << 32,
            total_size: 1 << 40,
            stream: 0,
            segment_type: "large".into(),
            blocks,
        };
        let mut stacks = Stacks::default();
        // Rebuild the table so the snapshot owns it; ids are assigned in the same order.
        for stack in 0..self.stacks.count() as StackId {
            let ids: Vec<u32> =
                self.stacks.frames(stack).map(|f| stacks.intern_frame(f.filename, f.line, f.name)).collect();
            assert_eq!(stacks.intern_stack(&ids), stack);
        }
        let mut events = self.events[start..].to_vec();
        for event in &mut events {
            event.annotation = event.annotation.map(|text| stacks.intern_string(self.stacks.string(text)));
        }
        let snapshot = AllocationHistory {
            segments: vec![segment],
            device_traces: vec![events],
            stacks,
            ..AllocationHistory::default()
        };
        (snapshot, self.truth[start..].to_vec(), self.by_site[start..].to_vec())
    }
}

pub(super) fn attribution<'a>(
    snapshot: &'a AllocationHistory,
    rule: &'a SiteRule,
    namer: &'a PlainNamer,
) -> Attribution<'a> {
    Attribution::new(&snapshot.stacks, rule, namer)
}

/// A training-like program: weights before recording, a forward with a quadratic scores
/// tensor, a backward from autograd's thread (no frames), an optimizer step.
fn training(batch: u64) -> Program {
    let mut p = Program::new();
    let init =
        p.stack(&[("/usr/lib/python3.11/site-packages/torch/nn/modules/module.py", 900, "_apply"), (USER, 3, "main")]);
    let site = format!("{USER}:3");
    p.alloc(4 << 20, init, &site);
    let old = p.alloc(3 << 20, init, &site);
    let fwd = p.line(10);
    let scores_line = p.line(14);
    let x = p.alloc(batch * 1000, fwd, &format!("{USER}:10"));
    let scores = p.alloc(batch * batch * 1000, scores_line, &format!("{USER}:14"));
    let tmp = p.alloc(batch * 7, fwd, &format!("{USER}:10"));
    p.free(tmp);
    p.free(old);
    let backward = p.stack(&[
        ("/usr/lib/python3.11/site-packages/torch/autograd/__init__.py", 200, "backward"),
        (USER, 20, "step"),
    ]);
    p.event(Action::AllocationHistory, backward);
    p.alloc(4 << 20, 0, "backward");
    p.free(scores);
    p.free(x);
    let step = p.stack(&[("/usr/lib/python3.11/site-packages/torch/optim/adam.py", 90, "step"), (USER, 22, "step")]);
    p.alloc(1 << 20, step, &format!("{USER}:22"));
    p
}

#[test]
fn the_replay_equals_torchs_allocated_at_every_event_to_the_byte() {
    for start in [0, 1, 2, 3, 7] {
        let program = training(64);
        let (snapshot, truth, _) = program.snapshot(start);
        let replay = replay(&snapshot, 0, None);
        assert_eq!(replay.allocated, truth, "recording from event {start}");
        let max = *truth.iter().max().unwrap();
        assert_eq!(replay.peak.bytes, max, "from {start}");
        assert_eq!(replay.peak.event, truth.iter().position(|&b| b == max));
    }
}

#[test]
fn blocks_from_before_recording_are_reconstructed_and_a_wrapped_buffer_is_said() {
    let program = training(64);
    let (snapshot, truth, _) = program.snapshot(2);
    let replay = replay(&snapshot, 0, Some(snapshot.device_traces[0].len()));
    // The weights (alive throughout) and `old` (freed in the trace) were allocated before it.
    assert_eq!(replay.baseline, truth[0] - replay.allocated[0] + replay.baseline);
    assert_eq!(replay.completeness.unknown_frees, 1);
    assert_eq!(replay.completeness.alive_from_before, 1);
    assert!(replay.completeness.may_have_wrapped);
    assert_eq!(replay.completeness.unknown.len(), 3, "{:?}", replay.completeness.unknown);
    let full = training(64).snapshot(0).0;
    let whole = super::replay(&full, 0, Some(10_000));
    assert!(!whole.completeness.may_have_wrapped);
    assert!(whole.completeness.unknown.is_empty());
}

#[test]
fn bytes_per_site_at_the_peak_equal_the_truth() {
    for start in [0, 2] {
        let program = training(128);
        let (snapshot, truth, by_site) = program.snapshot(start);
        let (rule, namer) = (SiteRule::default(), PlainNamer::default());
        let replay = replay(&snapshot, 0, None);
        let sites = peak_sites(&replay, &attribution(&snapshot, &rule, &namer), 10);
        let at = replay.peak.event.unwrap();
        assert_eq!(sites.table.total, truth[at]);
        let true_sites = &by_site[at];
        for row in &sites.table.all {
            let expected: u64 = match row.label.as_str() {
                label if label.starts_with(USER) => {
                    *true_sites.get(label).unwrap_or_else(|| panic!("{label} not in {true_sites:?}"))
                }
                "backward at /home/u/train.py:20" => true_sites["backward"],
                label => panic!("unexpected site {label}"),
            };
            assert_eq!(row.bytes, expected, "{}", row.label);
        }
    }
}

fn peak_of(batch: u64) -> PeakSites {
    let (snapshot, _, _) = training(batch).snapshot(0);
    let (rule, namer) = (SiteRule::default(), PlainNamer::default());
    let replay = replay(&snapshot, 0, None);
    peak_sites(&replay, &attribution(&snapshot, &rule, &namer), TOP_SITES)
}

#[test]
fn the_peak_table_shows_the_top_sites_the_rest_and_the_categories_in_text_html_and_json() {
    let sites = peak_of(128);
    assert_eq!(sites.table.sites[0].label, format!("{USER}:14"), "the scores are the largest at bs 128");
    assert!(sites.table.all.iter().any(|row| row.label == format!("{USER}:14")), "the scores are live at the peak");
    let grid = sites.table.grid("t".into(), Vec::new());
    assert_eq!(text_cells(&grid.to_text()), expected_cells(&grid));
    assert_eq!(html_cells(&grid.to_html()), expected_cells(&grid));
    assert!(sites.to_html().contains("<details><summary>"), "each stack collapsible");
    let few = {
        let (snapshot, _, _) = training(128).snapshot(0);
        let (rule, namer) = (SiteRule::default(), PlainNamer::default());
        let replay = replay(&snapshot, 0, None);
        peak_sites(&replay, &attribution(&snapshot, &rule, &namer), 1)
    };
    assert_eq!(few.table.sites.len(), 1);
    assert_eq!(few.table.rest.sites, few.table.all.len() - 1);
    assert_eq!(few.table.sites[0].bytes + few.table.rest.bytes, few.table.total);
    let categories: HashMap<&str, u64> =
        sites.table.categories.iter().map(|c| (c.category.as_str(), c.bytes)).collect();
    assert_eq!(categories[Category::Gradients.label()], 4 << 20, "made in backward, kept");
    assert_eq!(categories[Category::Parameters.label()], 4 << 20, "made under Module.to");
    assert_eq!(categories[Category::Activations.label()], block_of(128 * 1000) + block_of(128 * 128 * 1000));
    let json = sites.to_json();
    assert_eq!(json["peak"]["bytes"], sites.peak.bytes);
    assert!(json["sites"][0]["stack"][0].as_str().unwrap().contains("torch/nn/functional.py"));
}

#[test]
fn the_site_is_the_innermost_user_frame_and_library_frames_are_skipped() {
    let rule = SiteRule::default();
    for library in [
        TORCH,
        "/opt/venv/lib/python3.12/site-packages/transformers/modeling.py",
        "/usr/lib/python3/dist-packages/numpy/core.py",
        "/usr/lib/python3.11/threading.py",
        "<frozen runpy>",
        "/home/u/.venv/src/gpuexp/experiment.py",
        "C:\\Python311\\Lib\\site-packages\\torch\\nn\\modules\\module.py",
    ] {
        assert!(!rule.is_user(library), "{library}");
    }
    assert!(rule.is_user("/tmp/ipykernel_4242/2764212475.py"));
    assert!(rule.is_user(USER));
    let mut p = Program::new();
    let stack = p.stack(&[("/usr/lib/python3.11/threading.py", 1, "run"), (USER, 7, "inner"), (USER, 30, "outer")]);
    let frame = rule.user_frame(&p.stacks, stack).unwrap();
    assert_eq!((frame.filename, frame.line), (USER, 7));
    let narrower = SiteRule::default().with(["/home/u/".to_string()]);
    assert!(narrower.user_frame(&p.stacks, stack).is_none());
}

#[test]
fn a_block_without_a_user_frame_goes_by_its_phase_and_is_never_dropped() {
    let mut p = Program::new();
    p.alloc(1 << 20, 0, "(no Python frame)");
    let (snapshot, _, _) = p.snapshot(0);
    let (rule, namer) = (SiteRule::default(), PlainNamer::default());
    let replay = replay(&snapshot, 0, None);
    let sites = peak_sites(&replay, &attribution(&snapshot, &rule, &namer), 10);
    assert_eq!(sites.table.sites[0].label, "(no Python frame)");
    let sites = peak_of(64);
    assert!(sites.table.all.iter().any(|row| row.label == format!("backward at {USER}:20")));
}

#[test]
fn the_namer_reads_the_source_line_of_a_file() {
    let dir = std::env::temp_dir().join(format!("gpuexp-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("model.py");
    std::fs::write(&file, "import torch\n    scores = q @ k.transpose(-2, -1)\n").unwrap();
    let namer = PlainNamer::default();
    let name = file.to_str().unwrap();
    assert_eq!(namer.source(name, 2).as_deref(), Some("scores = q @ k.transpose(-2, -1)"));
    assert_eq!(namer.source(name, 9), None);
    assert_eq!(namer.label(name, 2), format!("{name}:2"));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn the_fixtures_pickled_by_python_read_the_same_at_every_protocol() {
    for fixture in [
        &include_bytes!("testdata/snapshot_p2.pickle")[..],
        include_bytes!("testdata/snapshot_p4.pickle"),
        include_bytes!("testdata/snapshot_p5.pickle"),
    ] {
        let snapshot = AllocationHistory::from_pickle(fixture).unwrap();
        let events = &snapshot.device_traces[0];
        let actions: Vec<Action> = events.iter().map(|e| e.action).collect();
        assert_eq!(
            actions,
            [
                Action::SegmentAlloc,
                Action::Alloc,
                Action::Alloc,
                Action::FreeRequested,
                Action::FreeCompleted,
                Action::Oom,
                Action::Other
            ]
        );
        assert_eq!((events[1].addr, events[1].size, events[1].time_us), (1 << 30, 1000, 11));
        assert_eq!(events[5].device_free, 123);
        assert_eq!(events[2].annotation.map(|id| snapshot.stacks.string(id)), Some("model.layers.3.attn"));
        assert_eq!(events[1].annotation, None, "an empty user_metadata is none");
        assert_eq!(events[1].stack, events[3].stack, "one stack stored once");
        let frames: Vec<(&str, u32)> = snapshot.stacks.frames(events[2].stack).map(|f| (f.filename, f.line)).collect();
        assert_eq!(frames[1], (USER, 15));
        assert_eq!(snapshot.segments[0].blocks[1].state, BlockState::ActiveAllocated);
        assert_eq!(snapshot.segments[0].blocks[2].stack, 0, "no frames: the bare stack");
        let replay = replay(&snapshot, 0, None);
        assert_eq!(replay.peak.bytes, 1024 + 4096);
        assert_eq!(replay.allocated.last(), Some(&4096));
        let (rule, namer) = (SiteRule::default(), PlainNamer::default());
        let ooms = oom(&snapshot, &replay, &attribution(&snapshot, &rule, &namer), 10);
        assert_eq!(ooms.len(), 1);
        assert_eq!(ooms[0].site.label, format!("{USER}:16"));
        assert_eq!(ooms[0].live.sites[0].label, format!("{USER}:15"));
        assert_eq!((ooms[0].requested, ooms[0].device_free), (1 << 40, 123));
    }
    let first = AllocationHistory::from_pickle(include_bytes!("testdata/snapshot_p4.pickle")).unwrap();
    let reordered = AllocationHistory::from_pickle(include_bytes!("testdata/snapshot_reordered.pickle")).unwrap();
    assert_eq!(reordered.device_traces, first.device_traces, "an event with its action last reads the same");
    let error = AllocationHistory::from_pickle(b"not a pickle").unwrap_err();
    assert!(error.to_string().contains("torch.cuda.memory._snapshot()"), "{error}");
    let whole = include_bytes!("testdata/snapshot_p4.pickle");
    let error = AllocationHistory::from_pickle(&whole[..whole.len() / 2]).unwrap_err();
    assert!(error.to_string().contains("ends early"), "{error}");
}

#[test]
fn a_large_block_keeps_the_whole_segment_when_too_little_is_left_to_split() {
    let mut p = Program::new();
    let stack = p.line(5);
    // 11 MiB + 1 from a fresh 12 MiB segment: less than 1 MiB left, torch keeps all 12.
    let addr = p.next_addr;
    p.events.push(Event {
        action: Action::SegmentAlloc,
        addr,
        size: 12 << 20,
        stream: 0,
        time_us: 0,
        stack,
        device_free: 0,
        annotation: None,
    });
    p.events.push(Event {
        action: Action::Alloc,
        addr,
        size: (11 << 20) + 1,
        stream: 0,
        time_us: 1,
        stack,
        device_free: 0,
        annotation: None,
    });
    p.events.push(Event {
        action: Action::FreeRequested,
        addr,
        size: (11 << 20) + 1,
        stream: 0,
        time_us: 2,
        stack,
        device_free: 0,
        annotation: None,
    });
    p.truth = Vec::new();
    let snapshot = AllocationHistory {
        segments: Vec::new(),
        device_traces: vec![p.events.clone()],
        stacks: p.snapshot(0).0.stacks,
        ..AllocationHistory::default()
    };
    let replay = replay(&snapshot, 0, None);
    assert_eq!(replay.allocated, [0, 12 << 20, 0]);
}

#[test]
fn blocks_alive_at_the_end_are_given_their_sites_for_the_leak_report() {
    let (snapshot, _, _) = training(64).snapshot(0);
    let (rule, namer) = (SiteRule::default(), PlainNamer::default());
    let replay = replay(&snapshot, 0, None);
    let attribution = attribution(&snapshot, &rule, &namer);
    let held = still_held(&replay, &attribution, None);
    let mut labels: Vec<&str> = held.iter().map(|h| h.site.label.as_str()).collect();
    labels.sort_unstable();
    assert_eq!(labels, [format!("{USER}:22"), format!("{USER}:3"), format!("backward at {USER}:20")]);
    let first = held.iter().find(|h| h.site.label.ends_with(":22")).unwrap();
    let only = still_held(&replay, &attribution, Some(&[first.addr, 7]));
    assert_eq!(only, vec![first.clone()], "an address with no live block is skipped");
}

#[test]
fn the_diff_attributes_the_growth_to_sites_and_relates_it_to_the_param() {
    let (a, b) = (peak_of(64), peak_of(128));
    let params = |bs: i64| Params(vec![("bs".into(), Param::Int(bs))]);
    let diff = diff(&a, &b, &params(64), &params(128));
    assert_eq!(diff.delta, b.peak.bytes as i64 - a.peak.bytes as i64);
    assert_eq!(diff.rows.iter().map(|row| row.delta).sum::<i64>(), diff.delta, "the sites add up to the change");
    let scores = &diff.rows[0];
    assert_eq!(scores.label, format!("{USER}:14"), "largest growth first");
    assert_eq!(scores.growth, Growth::Quadratic);
    assert!(scores.text.starts_with("+"), "{}", scores.text);
    assert!(scores.text.ends_with("4.0× (bs 64 → 128), quadratic in bs"), "{}", scores.text);
    let x = diff.rows.iter().find(|row| row.label == format!("{USER}:10")).unwrap();
    assert_eq!(x.growth, Growth::Linear);
    let weights = diff.rows.iter().find(|row| row.label == format!("{USER}:3")).unwrap();
    assert_eq!(weights.growth, Growth::Constant);
    let grid = diff.grid();
    assert_eq!(text_cells(&grid.to_text()), expected_cells(&grid));
    assert_eq!(diff.to_json()["rows"][0]["growth"]["kind"], "quadratic");
    let unrelated = super::diff(&a, &b, &Params::default(), &Params::default());
    assert_eq!(unrelated.rows[0].growth, Growth::Factor(4.0));
}

#[test]
fn the_timeline_stacks_the_top_sites_keeps_the_peak_and_has_at_most_600_points() {
    let mut p = Program::new();
    let lines: Vec<StackId> = (1..=4).map(|line| p.line(line)).collect();
    let mut held = Vec::new();
    for i in 0..3000u64 {
        let addr = p.alloc(512 * (1 + i % 7), lines[(i % 4) as usize], "x");
        held.push(addr);
        if held.len() > 50 + (i as usize % 37) {
            p.free(held.remove(0));
        }
    }
    let (snapshot, truth, _) = p.snapshot(0);
    let (rule, namer) = (SiteRule::default(), PlainNamer::default());
    let replay = replay(&snapshot, 0, None);
    let timeline = timeline(&replay, &attribution(&snapshot, &rule, &namer), 3);
    assert!(timeline.x.len() <= MAX_POINTS + 1, "{}", timeline.x.len());
    assert_eq!(timeline.series.len(), 4, "three sites and the others");
    let point = timeline.peak_point.unwrap();
    assert_eq!(timeline.total[point], *truth.iter().max().unwrap());
    for (i, total) in timeline.total.iter().enumerate() {
        assert_eq!(timeline.series.iter().map(|s| s.y[i]).sum::<u64>(), *total, "point {i}");
    }
    let svg = timeline.to_svg();
    assert!(svg.starts_with("<svg") && svg.ends_with("</svg>"));
    assert!(!svg.contains("<script") && !svg.contains("src=") && !svg.contains("href"), "nothing fetched");
    assert_eq!(svg.matches("<polygon").count(), 4);
    assert!(svg.contains("var(--jp-warn-color0"), "the peak marked in the theme's colour");
}
