//! One allocation's life in the replayed trace, and where its site comes from.

use super::layout::{round, SMALL};
use super::parse::StackId;

/// One allocation's life in the trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Block {
    pub addr: u64,
    /// The block's size: what `memory_allocated` counts.
    pub bytes: u64,
    /// What the program asked for.
    pub requested: u64,
    /// The allocation's stack; for a block from before recording, the one the segments give, or 0.
    pub stack: StackId,
    /// The event that allocated it; None when that was before recording began.
    pub alloc_event: Option<usize>,
    /// The event that freed it (`free_requested`); None when alive at the end.
    pub free_event: Option<usize>,
    /// The module it was made in (an index into `Replay::modules`), where the hooks marked one.
    pub module: Option<u32>,
    /// `bytes` is the allocator's own figure (from its segments, or its layout followed from a
    /// known state), not inferred from the size asked for.
    pub exact: bool,
    /// Where its site comes from: its own stack, or a sampled step's block (`sampled`).
    pub sites: SiteSource,
}

impl Block {
    /// Alive just after event `event` (alive before recording counts as alive from the start).
    pub fn alive_after(&self, event: usize) -> bool {
        self.alloc_event.is_none_or(|a| a <= event) && self.free_event.is_none_or(|f| f > event)
    }

    pub fn before_recording(&self) -> bool {
        self.alloc_event.is_none()
    }

    /// How far the true size of a block whose size was inferred can be above and below `bytes`:
    /// torch's block is the request rounded to 512 bytes, or in the large pool the whole free
    /// block it was cut from when at most 1 MiB would have been left over.
    pub(super) fn uncertainty(&self) -> (u64, u64) {
        if self.exact {
            return (0, 0);
        }
        let least = round(self.requested);
        let most = if least > SMALL { least + SMALL } else { least };
        (most.saturating_sub(self.bytes), self.bytes.saturating_sub(least))
    }
}

/// Where a block's site comes from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SiteSource {
    /// Its own stack (or it has none to go by: made before recording, autograd's thread).
    #[default]
    Own,
    /// A sampled step's block (`step`: an index into `Replay::steps`).
    Mapped { step: u32 },
    /// Made in a step without stacks, with no block of a sampled step to map it to.
    Unattributed,
}
