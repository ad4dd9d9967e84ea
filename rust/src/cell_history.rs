//! The cell log's share of torch's allocation history, with the log on and the trace on (for
//! every experiment by `gpuexp.config(trace=True)`, or for one that is open): joined once, at
//! the first logged cell that starts with CUDA initialised (the log never creates a CUDA
//! context), kept across cells, and given back as soon as the log or the trace is turned off,
//! so no recording outlives them. The decisions run here over [`CellWorld`]; the bindings read
//! the history only when a cell's torch peak moved.

use crate::fork::{Guard, PerProcess};
use crate::torch_history::{self, now_us, TraceWindow};

/// What the cell log's share needs from the settings and torch.
pub trait CellWorld {
    /// The cell log is on over GPUs.
    fn logging(&self) -> bool;
    /// Every experiment traces torch's allocations (`gpuexp.config(trace=True)`).
    fn traced_by_default(&self) -> bool;
    fn cuda_initialised(&self) -> bool;
    /// Joins the recording with stacks (`torch_history::open`).
    fn open(&self) -> (TraceWindow, Vec<String>);
    /// Gives the share back (`torch_history::close`): a note where changing the recording failed.
    fn close(&self) -> Option<String>;
}

/// The cell log's share while it holds one.
struct CellLogShare {
    /// The ring buffer's size when gpuexp started the recording (None: the user's).
    max_entries: Option<u64>,
    /// When the running cell's window opened, in Unix microseconds (torch's `time_us` clock).
    cell_opened_us: i64,
    /// When the last logged cell ended: the next cell's window opens there when it carries on
    /// from it, as its figures do.
    last_end_us: Option<i64>,
}

/// A forked child holds no share of the parent's recording (torch_history forgets it too).
static SHARE: PerProcess<Option<CellLogShare>> = PerProcess::new(|| None);

fn share() -> Guard<'static, Option<CellLogShare>> {
    SHARE.lock()
}

/// Whether the cell log should record: the log is on over GPUs, and the trace is on (for every
/// experiment, or for one that is open: a share of the recording beyond the log's own, which
/// `log_holds` tells).
fn wanted(world: &dyn CellWorld, log_holds: bool) -> bool {
    world.logging() && (world.traced_by_default() || torch_history::open_shares() > usize::from(log_holds))
}

/// At a logged cell's start, once its window is open: joins the recording where the log wants
/// one and CUDA is initialised, and opens the cell's window of it. `carried` tells that the
/// cell's figures start where the last cell ended. Returns the notes of the joining.
pub fn begin_cell(world: &dyn CellWorld, carried: bool) -> Vec<String> {
    let now = now_us();
    if let Some(held) = share().as_mut() {
        held.cell_opened_us = held.last_end_us.filter(|_| carried).unwrap_or(now);
        return Vec::new();
    }
    if !wanted(world, false) || !world.cuda_initialised() {
        return Vec::new();
    }
    let (window, notes) = world.open();
    if window.unavailable.is_some() {
        // Torch without a CUDA GPU: the log stays as it is, and the next cell asks again.
        return Vec::new();
    }
    *share() = Some(CellLogShare { max_entries: window.max_entries, cell_opened_us: now, last_end_us: None });
    notes
}

/// At a logged cell's end: the window of the history it ran in (when it opened, the ring
/// buffer's size), where the cell log holds a share.
pub fn end_cell() -> Option<(i64, Option<u64>)> {
    let mut share = share();
    let held = share.as_mut()?;
    held.last_end_us = Some(now_us());
    Some((held.cell_opened_us, held.max_entries))
}

/// Gives the cell log's share back where the log or the trace is now off: the recording stops
/// if gpuexp started it and no traced experiment still needs it. Cheap when no share is held.
/// Returns a note where changing the recording failed.
pub fn settle(world: &dyn CellWorld) -> Option<String> {
    let holds = share().is_some();
    if !holds || wanted(world, true) {
        return None;
    }
    *share() = None;
    world.close()
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    struct Fake {
        logging: Cell<bool>,
        opened: Cell<u32>,
        closed: Cell<u32>,
    }

    impl CellWorld for Fake {
        fn logging(&self) -> bool {
            self.logging.get()
        }
        fn traced_by_default(&self) -> bool {
            true
        }
        fn cuda_initialised(&self) -> bool {
            true
        }
        fn open(&self) -> (TraceWindow, Vec<String>) {
            self.opened.set(self.opened.get() + 1);
            (TraceWindow { opened_us: 0, max_entries: Some(9), unavailable: None }, vec!["joined".into()])
        }
        fn close(&self) -> Option<String> {
            self.closed.set(self.closed.get() + 1);
            None
        }
    }

    #[test]
    fn the_share_is_joined_once_kept_across_cells_and_given_back_when_the_log_stops() {
        let world = Fake { logging: Cell::new(true), opened: Cell::new(0), closed: Cell::new(0) };
        assert_eq!(begin_cell(&world, false), ["joined"]);
        let (first_opened, max_entries) = end_cell().expect("a share");
        assert_eq!(max_entries, Some(9));
        assert!(begin_cell(&world, true).is_empty());
        let (carried_from, _) = end_cell().expect("a share");
        assert!(carried_from >= first_opened, "a carried cell opens where the last one ended");
        assert_eq!(world.opened.get(), 1);
        assert_eq!(settle(&world), None);
        assert_eq!(world.closed.get(), 0, "the log is still on");
        world.logging.set(false);
        settle(&world);
        assert_eq!(world.closed.get(), 1);
        assert_eq!(end_cell(), None);
    }
}
