//! How much a file may have the reader and the builder do and hold: a pickle refers back to
//! what it made in a few bytes, so a small file could otherwise make the reader build
//! gigabytes, or take minutes over a string it refers to a thousand times.

/// What a file of `n` bytes may have the builder visit, in items (an event copied, a block, a
/// frame of a stack, an entry of a dict read): 80 KB of references to references would
/// otherwise visit 400 million events. Torch's own files take a few items per byte at most (an
/// event is some 100 bytes).
const ITEMS_PER_BYTE: usize = 16;
/// And whatever the file's size: a small file is never refused for its size.
const ITEMS_AT_LEAST: usize = 1 << 20;

/// What a file of `n` bytes may have the reader and the builder hold, in bytes counted as
/// they are made (a value on the stack or in the memo, a container, a string, an event, a
/// stack's frames). Torch's own files count under 2 bytes a byte (an event of some 150 bytes
/// makes its dict, its frames list and a 56-byte `Event`). What is counted is what is held;
/// vectors that doubled hold at most twice that, hence docs/robustness.md's bound of
/// 8 bytes a byte and 256 MiB.
pub const HELD_PER_BYTE: usize = 4;
/// And whatever the file's size.
pub const HELD_AT_LEAST: usize = 128 << 20;

/// Items and bytes left; once either is spent, the builder builds nothing more and the read
/// is refused.
#[derive(Debug, Default)]
pub(super) struct Budget {
    pub(super) limit: usize,
    left: usize,
    pub(super) held_limit: usize,
    held_left: usize,
    /// Items visited and bytes made since Ctrl-C was last looked for.
    pub(super) since_check: usize,
}

impl Budget {
    pub(super) fn of(bytes: usize) -> Budget {
        let limit = bytes.saturating_mul(ITEMS_PER_BYTE).saturating_add(ITEMS_AT_LEAST);
        let held_limit = bytes.saturating_mul(HELD_PER_BYTE).saturating_add(HELD_AT_LEAST);
        Budget { limit, left: limit, held_limit, held_left: held_limit, since_check: 0 }
    }

    /// Takes `items` from what is left: false (and nothing taken) when that is too few.
    pub(super) fn charge(&mut self, items: usize) -> bool {
        self.since_check = self.since_check.saturating_add(items);
        take(&mut self.left, items) && self.held_left > 0
    }

    /// Counts `bytes` more held: false when that is past the limit.
    pub(super) fn hold(&mut self, bytes: usize) -> bool {
        self.since_check = self.since_check.saturating_add(bytes / 16);
        take(&mut self.held_left, bytes)
    }

    pub(super) fn spent(&self) -> bool {
        self.left == 0 || self.held_left == 0
    }
}

/// `n` from `left`, or `left` emptied when that is too few.
fn take(left: &mut usize, n: usize) -> bool {
    match left.checked_sub(n) {
        Some(rest) => {
            *left = rest;
            true
        }
        None => {
            *left = 0;
            false
        }
    }
}
