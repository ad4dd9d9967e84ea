//! Host memory by source line (`trace="host"`): what Python's allocations (tracemalloc: Python
//! objects, NumPy's buffers) grew by between an experiment's opening and its finish, grouped by
//! the innermost frame in the user's code, as the CUDA trace groups its blocks.

use std::collections::HashMap;

use serde::Serialize;

use super::parse::{StackId, Stacks};
use super::peak::SiteRow;
use super::peak::SiteTable;
use super::sites::{SiteNamer, SiteRule};
use crate::units::bytes;

/// The frames tracemalloc keeps per allocation when gpuexp starts it. Each allocation pays for
/// each frame kept (its line number is looked up then, and IPython's frames under a cell's are
/// large): in a kernel, a loop of small strings ran 11× slower than untraced with 1 frame, 19×
/// with 3, 140× with 5 and 700× with 25. Three reach the user's line under a library's Python
/// wrapper one or two calls deep (`np.ones`).
pub const HOST_FRAMES: u32 = 3;

/// Frames enough to reach the user's line under a library's Python code (a DataFrame built
/// inside pandas is dozens of frames deep): what the note on a frameless row suggests.
pub const DEEP_FRAMES: u32 = 25;

/// The label of allocations with no frame in the user's code (a library's thread, an import).
pub const NO_USER_FRAME: &str = "(no frame of yours)";

/// One traceback's change between the two snapshots, as tracemalloc's
/// `compare_to(start, "traceback")` gives it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostTraceback {
    /// Its frames innermost first (their names empty: tracemalloc keeps none).
    pub stack: StackId,
    /// Bytes allocated and still alive at finish, less those alive at opening.
    pub bytes: i64,
    /// Allocations, the same way.
    pub count: i64,
}

/// What the bindings read from tracemalloc: the live traces at opening counted negative and
/// those at finish positive ([`HostGrowth::tally`]), so that each traceback's sum is its growth.
#[derive(Debug, Default)]
pub struct HostGrowth {
    pub stacks: Stacks,
    pub tracebacks: Vec<HostTraceback>,
    /// The frames tracemalloc kept per allocation (`HOST_FRAMES`, or the user's own setting).
    pub frames: u32,
    /// Where each stack's row is in `tracebacks`.
    rows: HashMap<StackId, usize>,
}

impl HostGrowth {
    /// Adds `bytes` and `count` to the traceback `stack`'s row (negative: live at opening).
    pub fn tally(&mut self, stack: StackId, bytes: i64, count: i64) {
        let next = self.tracebacks.len();
        let row = *self.rows.entry(stack).or_insert(next);
        if row == next {
            self.tracebacks.push(HostTraceback { stack, bytes: 0, count: 0 });
        }
        let traceback = &mut self.tracebacks[row];
        traceback.bytes += bytes;
        traceback.count += count;
    }
}

/// Sites whose memory shrank (freed more than they made), together.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Shrunk {
    pub sites: usize,
    pub bytes: u64,
}

/// The host's growth by site: the table holds the sites that grew.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct HostTrace {
    /// The net change of what tracemalloc saw, opening to finish (negative: more was freed).
    pub net_bytes: i64,
    #[serde(flatten)]
    pub table: SiteTable,
    pub shrunk: Shrunk,
    /// The frames kept per allocation.
    pub frames: u32,
    pub notes: Vec<String>,
}

/// Per site: net bytes, net allocations, and its largest traceback (the one most worth reading).
type Grouped = HashMap<Option<(u32, u32)>, (i64, i64, HostTraceback)>;

/// Groups `growth` by the innermost frame `rule` calls the user's, named by `namer`; `notes`
/// are the recording's own (a shared tracemalloc, say).
pub fn host_sites(
    growth: &HostGrowth,
    rule: &SiteRule,
    namer: &dyn SiteNamer,
    top: usize,
    mut notes: Vec<String>,
) -> HostTrace {
    let mut by_site: Grouped = HashMap::new();
    // A traceback live at both ends with the same size and number is no growth.
    for traceback in growth.tracebacks.iter().filter(|t| t.bytes != 0 || t.count != 0) {
        let key = rule.user_frame(&growth.stacks, traceback.stack).map(|frame| (frame.file, frame.line));
        let entry = by_site.entry(key).or_insert((0, 0, *traceback));
        entry.0 += traceback.bytes;
        entry.1 += traceback.count;
        if traceback.bytes > entry.2.bytes {
            entry.2 = *traceback;
        }
    }
    let net_bytes = by_site.values().map(|site| site.0).sum();
    let mut shrunk = Shrunk::default();
    let mut grew = Vec::new();
    for (key, (site_bytes, count, largest)) in by_site {
        if site_bytes <= 0 {
            shrunk.sites += usize::from(site_bytes < 0);
            shrunk.bytes += site_bytes.unsigned_abs();
            continue;
        }
        let (label, source) = match key {
            Some((file, line)) => namer.named(growth.stacks.string(file), line),
            None => (NO_USER_FRAME.to_string(), None),
        };
        let stack =
            growth.stacks.frames(largest.stack).map(|frame| format!("{}:{}", frame.filename, frame.line)).collect();
        grew.push(SiteRow {
            label,
            source,
            bytes: site_bytes.unsigned_abs(),
            blocks: usize::try_from(count.max(0)).unwrap_or(usize::MAX),
            share: 0.0,
            stack,
        });
    }
    if shrunk.sites > 0 {
        notes.push(format!("{} sites shrank by {} together (not in the table)", shrunk.sites, bytes(shrunk.bytes)));
    }
    if growth.frames < DEEP_FRAMES && grew.iter().any(|row| row.label == NO_USER_FRAME) {
        notes.push(format!(
            "tracemalloc keeps {} frame(s) per allocation: what a library allocates in its own Python code shows as \
             {NO_USER_FRAME}; tracemalloc.start({DEEP_FRAMES}) before the experiment keeps enough to find your line \
             (each allocation then runs slower)",
            growth.frames
        ));
    }
    let total = grew.iter().map(|row| row.bytes).sum();
    HostTrace {
        net_bytes,
        table: SiteTable::ranked(grew, total, top, Vec::new()),
        shrunk,
        frames: growth.frames,
        notes,
    }
}

impl HostTrace {
    fn title(&self) -> String {
        let net = if self.net_bytes < 0 {
            format!("-{}", bytes(self.net_bytes.unsigned_abs()))
        } else {
            format!("+{}", bytes(self.net_bytes.unsigned_abs()))
        };
        format!("Host: Python's allocations grown by source line (tracemalloc), {net} net")
    }

    fn grid(&self) -> crate::grid::Grid {
        self.table.grid_counting("allocations", self.title(), self.notes.clone())
    }

    pub fn to_text(&self) -> String {
        self.grid().to_text()
    }

    pub fn to_html(&self) -> String {
        format!("{}{}", self.grid().to_html(), self.table.stacks_html())
    }

    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).expect("plain data serializes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grid::testing::text_cells;
    use crate::trace::PlainNamer;

    const CELL: &str = "/tmp/ipykernel_7/12.py";
    const NUMPY: &str = "/venv/lib/python3.12/site-packages/numpy/core/numeric.py";
    const MIB: i64 = 1 << 20;

    /// A traceback's frames (file, line), innermost first; its bytes and allocations.
    type Row<'a> = (&'a [(&'a str, u32)], i64, i64);

    fn growth(rows: &[Row], frames: u32) -> HostGrowth {
        let mut growth = HostGrowth { frames, ..HostGrowth::default() };
        for (stack, bytes, count) in rows {
            let ids: Vec<u32> = stack.iter().map(|(file, line)| growth.stacks.intern_frame(file, *line, "")).collect();
            let stack = growth.stacks.intern_stack(&ids);
            growth.tally(stack, *bytes, *count);
        }
        growth
    }

    fn bytes_by_label(trace: &HostTrace) -> HashMap<String, u64> {
        trace.table.sites.iter().map(|row| (row.label.clone(), row.bytes)).collect()
    }

    #[test]
    fn growth_goes_to_the_innermost_user_line_whatever_library_made_it() {
        let data = growth(
            &[
                (&[(CELL, 4)], 40 * MIB, 1),
                // NumPy's Python frame, then the cell's line that called it.
                (&[(NUMPY, 190), (CELL, 5)], 8 * MIB, 1),
                (&[(NUMPY, 200), (CELL, 5)], MIB, 3),
                (&[(CELL, 6)], 3 * MIB, 2),
                (&[(CELL, 6), (CELL, 9)], -MIB, -1),
                (&[(NUMPY, 10)], 512, 4),
            ],
            DEEP_FRAMES,
        );
        let trace = host_sites(&data, &SiteRule::default(), &PlainNamer::default(), 10, Vec::new());
        let sites = bytes_by_label(&trace);
        assert_eq!(sites[&format!("{CELL}:4")], 40 << 20);
        assert_eq!(sites[&format!("{CELL}:5")], 9 << 20);
        assert_eq!(sites[&format!("{CELL}:6")], 2 << 20, "net of what the line freed");
        assert_eq!(sites[NO_USER_FRAME], 512);
        let five = trace.table.sites.iter().find(|row| row.label.ends_with(":5")).expect("line 5");
        assert_eq!(five.blocks, 4);
        assert_eq!(five.stack[..], [format!("{NUMPY}:190"), format!("{CELL}:5")], "its largest traceback");
        assert_eq!(trace.table.sites[0].label, format!("{CELL}:4"), "largest first");
        assert_eq!(trace.table.total, (51 << 20) + 512);
        assert_eq!(trace.net_bytes, 51 * MIB + 512);
        assert!(trace.notes.is_empty(), "{:?}", trace.notes);
    }

    #[test]
    fn sites_that_shrank_are_left_out_of_the_table_and_counted_in_a_note() {
        let data = growth(&[(&[(CELL, 2)], 5 * MIB, 1), (&[(CELL, 3)], -2 * MIB, -2)], HOST_FRAMES);
        let trace = host_sites(&data, &SiteRule::default(), &PlainNamer::default(), 10, vec!["shared".into()]);
        assert_eq!(trace.table.sites.len(), 1);
        assert_eq!(trace.shrunk, Shrunk { sites: 1, bytes: 2 << 20 });
        assert_eq!(trace.net_bytes, 3 * MIB);
        assert_eq!(trace.notes, ["shared", "1 sites shrank by 2.00 MiB together (not in the table)"]);
        assert!(trace.to_text().contains("+3.00 MiB net"), "{}", trace.to_text());
    }

    #[test]
    fn past_the_top_sites_the_rest_is_one_row_and_the_table_counts_allocations() {
        let stacks: Vec<[(&str, u32); 1]> = (1..=12).map(|line| [(CELL, line)]).collect();
        let rows: Vec<Row> = stacks.iter().zip(1..).map(|(stack, line)| (&stack[..], line * MIB, 1)).collect();
        let trace =
            host_sites(&growth(&rows, HOST_FRAMES), &SiteRule::default(), &PlainNamer::default(), 10, Vec::new());
        assert_eq!(trace.table.sites.len(), 10);
        assert_eq!(trace.table.rest.sites, 2);
        assert_eq!(trace.table.rest.bytes, 3 << 20, "lines 1 and 2");
        let cells = text_cells(&trace.to_text());
        assert!(cells
            .iter()
            .any(|row| row.first().is_some_and(|c| c == "site") && row.contains(&"allocations".to_string())));
        assert!(cells.iter().any(|row| row.first().is_some_and(|c| c == "the rest (2 sites)")));
        let json = trace.to_json();
        assert_eq!(json["sites"][0]["bytes"], 12 << 20);
        assert_eq!(json["net_bytes"], 78 * MIB);
        assert!(trace.to_html().contains("<details>"), "each site's stack is collapsible");
    }

    #[test]
    fn what_was_live_at_opening_is_taken_from_what_is_live_at_finish() {
        let mut data = HostGrowth { frames: HOST_FRAMES, ..HostGrowth::default() };
        let kept = [data.stacks.intern_frame(CELL, 2, "")];
        let kept = data.stacks.intern_stack(&kept);
        let grew = [data.stacks.intern_frame(NUMPY, 7, ""), data.stacks.intern_frame(CELL, 3, "")];
        let grew = data.stacks.intern_stack(&grew);
        let freed = [data.stacks.intern_frame(CELL, 4, "")];
        let freed = data.stacks.intern_stack(&freed);
        // At opening: line 2 held 1 MiB in 2 allocations, line 3 one of 10 bytes, line 4 4 MiB.
        data.tally(kept, -MIB, -2);
        data.tally(grew, -10, -1);
        data.tally(freed, -4 * MIB, -1);
        // At finish: line 2 unchanged, line 3 grown to 3 MiB in 3 allocations, line 4 freed.
        data.tally(kept, MIB / 2, 1);
        data.tally(kept, MIB / 2, 1);
        data.tally(grew, 3 * MIB, 3);
        assert_eq!(data.tracebacks.len(), 3, "one row per traceback however often it is tallied");
        let trace = host_sites(&data, &SiteRule::default(), &PlainNamer::default(), 10, Vec::new());
        let sites = bytes_by_label(&trace);
        assert_eq!(sites.len(), 1, "{sites:?}");
        assert_eq!(sites[&format!("{CELL}:3")], (3 << 20) - 10);
        assert_eq!(trace.table.sites[0].blocks, 2);
        assert_eq!(trace.shrunk, Shrunk { sites: 1, bytes: 4 << 20 });
        assert_eq!(trace.net_bytes, 3 * MIB - 10 - 4 * MIB);
    }

    #[test]
    fn a_users_tracemalloc_with_few_frames_is_said() {
        let data = growth(&[(&[(NUMPY, 190)], MIB, 1)], 1);
        let trace = host_sites(&data, &SiteRule::default(), &PlainNamer::default(), 10, Vec::new());
        assert_eq!(bytes_by_label(&trace)[NO_USER_FRAME], 1 << 20);
        assert!(trace.notes.iter().any(|n| n.contains("keeps 1 frame(s)") && n.contains("tracemalloc.start(25)")));
        let mine = growth(&[(&[(CELL, 3)], MIB, 1)], 1);
        let trace = host_sites(&mine, &SiteRule::default(), &PlainNamer::default(), 10, Vec::new());
        assert!(trace.notes.is_empty(), "every allocation found its line: {:?}", trace.notes);
    }
}
