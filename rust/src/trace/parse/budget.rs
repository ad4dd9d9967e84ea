//! How much a file may have the builder make: a pickle refers back to what it made in a few
//! bytes, so a small file could otherwise make the reader build gigabytes.

/// What a file of `n` bytes may have the builder make or visit, in items (an event copied, a
/// block, a frame of a stack, an entry of a dict read): a pickle refers back to what it made
/// in a few bytes, so 80 KB of references to references would otherwise build 22 GB of
/// events. Torch's own files take a few items per byte at most (an event is some 100 bytes).
const ITEMS_PER_BYTE: usize = 16;
/// And whatever the file's size: a small file is never refused for its size.
const ITEMS_AT_LEAST: usize = 1 << 20;

/// Items left to the builder; once spent, it builds nothing more and the read is refused.
#[derive(Debug, Default)]
pub(super) struct Budget {
    pub(super) limit: usize,
    left: usize,
}

impl Budget {
    pub(super) fn of(bytes: usize) -> Budget {
        let limit = bytes.saturating_mul(ITEMS_PER_BYTE).saturating_add(ITEMS_AT_LEAST);
        Budget { limit, left: limit }
    }

    /// Takes `items` from what is left: false (and nothing taken) when that is too few.
    pub(super) fn charge(&mut self, items: usize) -> bool {
        match self.left.checked_sub(items) {
            Some(left) => {
                self.left = left;
                true
            }
            None => {
                self.left = 0;
                false
            }
        }
    }

    pub(super) fn spent(&self) -> bool {
        self.left == 0
    }
}
