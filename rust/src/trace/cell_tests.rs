//! A cell's peak by site on a scripted program: the top site is the line that allocated most of
//! what the cell itself had live at its peak, never memory from before the cell.

use super::tests::Program;
use super::*;

const MIB: u64 = 1 << 20;
const USER: &str = "/home/u/train.py";

/// Weights from an earlier cell (100 MiB at line 3), then a cell: 30 MiB at line 14, 10 MiB at
/// line 15, a 50 MiB temporary at line 16 (the peak), 5 MiB at line 17. Returns the program and
/// when the cell began.
fn program() -> (Program, i64) {
    let mut p = Program::new();
    let weights = p.line(3);
    p.alloc(100 * MIB, weights, "weights");
    let since = p.events.last().unwrap().time_us + 1;
    for (line, size) in [(14, 30), (15, 10)] {
        let stack = p.line(line);
        p.alloc(size * MIB, stack, &format!("{USER}:{line}"));
    }
    let temporary = p.line(16);
    let temporary = p.alloc(50 * MIB, temporary, &format!("{USER}:16"));
    p.free(temporary);
    let after = p.line(17);
    p.alloc(5 * MIB, after, &format!("{USER}:17"));
    (p, since)
}

#[test]
fn the_top_site_is_the_line_that_made_most_of_what_the_cell_had_live_at_its_peak() {
    let (program, since) = program();
    let (snapshot, _, _) = program.snapshot(0);
    let (rule, namer) = (SiteRule::default(), PlainNamer::default());
    let attribution = Attribution::new(&snapshot.stacks, &rule, &namer);
    let replayed = replay(&snapshot, 0, None);
    let top = cell_top_site(&replayed, &attribution, since).expect("the cell rose");
    assert_eq!(top.label, format!("{USER}:16"), "the weights are bigger, but not the cell's");
    assert_eq!(top.bytes, 50 * MIB);
    assert!((top.share - 50.0 / 90.0).abs() < 1e-9, "of the 90 MiB the cell had live: {}", top.share);

    let sites = cell_peak_sites(&snapshot, &[(0, 90 * MIB), (1, 5 * MIB)], None, since, &attribution);
    assert_eq!(sites.len(), 1, "cuda:1's trace holds nothing of the cell: {sites:?}");
    assert_eq!(sites[0].line(), format!("cuda:0 peak +90.00 MiB, 56% at {USER}:16"));
    let with_source = CellPeakSite { source: Some("y = x @ x".into()), ..sites[0].clone() };
    assert_eq!(with_source.line(), format!("cuda:0 peak +90.00 MiB, 56% at {USER}:16: y = x @ x"));
}

#[test]
fn a_cell_that_only_freed_or_ran_after_the_trace_has_no_top_site() {
    let (mut program, _) = program();
    let freeing = program.events.last().unwrap().time_us + 1;
    let weights = *program.events.first().map(|e| &e.addr).unwrap();
    program.free(weights);
    let (snapshot, _, _) = program.snapshot(0);
    let (rule, namer) = (SiteRule::default(), PlainNamer::default());
    let attribution = Attribution::new(&snapshot.stacks, &rule, &namer);
    let replayed = replay(&snapshot, 0, None);
    assert_eq!(cell_top_site(&replayed, &attribution, freeing), None, "nothing rose in the cell");
    assert_eq!(cell_top_site(&replayed, &attribution, i64::MAX), None, "no event in the cell");
}
