//! A file's long strings shared by many frames and sites: each site is named, and each stack
//! shown, in work and text bounded by the clipped strings, not by what they are clipped from.

use std::cell::RefCell;

use super::sites::LONGEST_PATH;
use super::*;

/// Notes the length of every filename it is asked about.
#[derive(Default)]
struct NotingNamer {
    asked: RefCell<Vec<(&'static str, usize)>>,
}

impl SiteNamer for NotingNamer {
    fn label(&self, filename: &str, line: u32) -> String {
        self.asked.borrow_mut().push(("label", filename.len()));
        format!("{filename}:{line}")
    }

    fn source(&self, filename: &str, _line: u32) -> Option<String> {
        self.asked.borrow_mut().push(("source", filename.len()));
        None
    }
}

#[test]
fn a_filename_longer_than_any_path_is_named_clipped_and_never_looked_up() {
    let huge = format!("/home/u/{}", "x".repeat(64 << 10));
    let mut p = super::tests::Program::new();
    for line in 1..=200 {
        let stack = p.stack(&[(huge.as_str(), line, "f")]);
        p.alloc(512, stack, "");
    }
    let (snapshot, _, _) = p.snapshot(0);
    let (rule, namer) = (SiteRule::default(), NotingNamer::default());
    assert!(rule.is_user(&huge), "no library's path is that long");
    let attribution = Attribution::new(&snapshot.stacks, &rule, &namer);
    let sites = peak_sites(&replay(&snapshot, 0, None), &attribution, TOP_SITES);
    assert_eq!(sites.table.all.len(), 200, "a site a line");
    for row in &sites.table.all {
        assert!(row.label.contains("…(") && row.label.len() < 2048 + 64, "{} bytes", row.label.len());
        assert!(row.stack.iter().map(String::len).sum::<usize>() < 2 * (2048 + 64), "clipped stack lines");
    }
    let asked = namer.asked.borrow();
    assert_eq!(asked.len(), 200, "one label a site, and no source: {:?}", &asked[..3]);
    assert!(asked.iter().all(|&(what, len)| what == "label" && len < 2048 + 64), "{:?}", &asked[..3]);
    drop(asked);
    // A path of the longest length is still looked up.
    let path = format!("/{}", "p".repeat(LONGEST_PATH - 1));
    assert_eq!(namer.named(&path, 3).1, None);
    assert!(namer.asked.borrow().contains(&("source", LONGEST_PATH)));
}

#[test]
fn the_stacks_of_many_sites_sharing_long_strings_show_a_bounded_text_in_all() {
    // 1,000 distinct stacks of 200 frames, every frame's name 1 MiB: some 200 KB of clipped
    // text a stack, 200 MB for all of them unbounded.
    let mut p = super::tests::Program::new();
    let (file, name) = (p.stacks.intern_string("/home/u/train.py"), p.stacks.intern_string(&"n".repeat(1 << 20)));
    for site in 0..1000u32 {
        let frames: Vec<u32> = (0..200).map(|i| p.stacks.intern_frame_ids(file, site * 200 + i, name)).collect();
        let stack = p.stacks.intern_stack(&frames);
        p.alloc(512, stack, "");
    }
    // The program's own stacks, as the reader made them (its `snapshot` interns them again).
    let snapshot =
        AllocationHistory { device_traces: vec![p.events], stacks: p.stacks, ..AllocationHistory::default() };
    let (rule, namer) = (SiteRule::default(), PlainNamer::default());
    let attribution = Attribution::new(&snapshot.stacks, &rule, &namer);
    let sites = peak_sites(&replay(&snapshot, 0, None), &attribution, TOP_SITES);
    assert_eq!(sites.table.all.len(), 1000);
    let text: usize = sites.table.all.iter().flat_map(|row| row.stack.iter()).map(String::len).sum();
    assert!(text <= (64 << 20) + (256 << 10) + 4096, "{text} bytes of stack text");
    let shortened = sites.table.all.iter().filter(|row| row.stack.len() == 1).count();
    assert!(shortened > 500, "past the budget a stack shows its count: {shortened}");
    let last = sites.table.all.iter().find(|row| row.stack.len() == 1).expect("one");
    assert!(last.stack[0].starts_with("… 200 more frames"), "{:?}", last.stack[0]);
}
