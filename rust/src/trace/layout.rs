//! The caching allocator's blocks as torch lays them out in its segments, followed event by
//! event, so that an allocation's block size is torch's, not a guess. Torch's trace records the
//! size asked for; the block is cut from the start of a free block, and split off only when
//! enough is left over (`should_split` in CUDACachingAllocator.cpp: any 512 bytes in the small
//! pool and in expandable segments, more than 1 MiB in the large pool); a block is merged with
//! its free neighbours in its segment when it is done (`free_completed`). Knowing where every
//! free block starts and ends therefore gives every block's size.
//!
//! A segment is known whole or not at all: one made during the trace, or one in the allocator's
//! state when the recording began (`opening`). An allocation anywhere else has no exact size.

use std::collections::BTreeMap;

use super::parse::{BlockState, Segment};

/// Requests up to this size go to the small pool (torch's kSmallSize); in the large pool, a
/// free block is split only when more than this would be left.
pub const SMALL: u64 = 1 << 20;

/// The caching allocator's rounding: whole 512-byte units, at least one.
pub fn round(requested: u64) -> u64 {
    requested.div_ceil(512).max(1) * 512
}

#[derive(Default)]
pub struct Layout {
    /// Known segments: start → end.
    segments: BTreeMap<u64, u64>,
    /// Free blocks of known segments: start → size.
    free: BTreeMap<u64, u64>,
    /// Blocks in use (allocated, or freed but still busy on a stream): start → size.
    busy: foldhash::HashMap<u64, u64>,
    /// Expandable segments split any 512 bytes, in both pools.
    expandable: bool,
}

impl Layout {
    /// The segments of the allocator's state when the recording began.
    pub fn opening(segments: &[&Segment]) -> Layout {
        let mut layout = Layout::default();
        for segment in segments {
            layout.segments.insert(segment.address, segment.address + segment.total_size);
            for block in &segment.blocks {
                match block.state {
                    BlockState::Inactive => layout.free.insert(block.address, block.size),
                    _ => layout.busy.insert(block.address, block.size),
                };
            }
        }
        layout
    }

    /// A segment made (`segment_alloc`): one free block.
    pub fn segment(&mut self, addr: u64, size: u64) {
        self.segments.insert(addr, addr + size);
        self.free.insert(addr, size);
    }

    /// Memory mapped into an expandable segment (`segment_map`): free, and joined to the free
    /// block just before it.
    pub fn map(&mut self, addr: u64, size: u64) {
        self.expandable = true;
        let start = match self.segment_of(addr.wrapping_sub(1)) {
            Some((start, end)) if end == addr => start,
            _ => addr,
        };
        self.segments.insert(start, addr + size);
        self.release(addr, size);
    }

    /// A segment given back (`segment_free`, `segment_unmap`): what it held is unknown from here.
    pub fn unmap(&mut self, addr: u64, size: u64) {
        let end = addr + size;
        let inside: Vec<u64> = self.free.range(addr..end).map(|(&start, _)| start).collect();
        for start in inside {
            self.free.remove(&start);
        }
        if let Some((start, segment_end)) = self.segment_of(addr) {
            self.segments.remove(&start);
            if start < addr {
                self.segments.insert(start, addr);
            }
            if segment_end > end {
                self.segments.insert(end, segment_end);
            }
        }
    }

    /// The block an allocation at `addr` got, where its segment is known.
    pub fn alloc(&mut self, addr: u64, requested: u64) -> Option<u64> {
        let rounded = round(requested);
        let extent = self.free.remove(&addr)?;
        let Some(left) = extent.checked_sub(rounded) else {
            // Torch never hands out a block larger than the free one: this layout is wrong.
            self.free.insert(addr, extent);
            return None;
        };
        let split = if rounded <= SMALL || self.expandable { left >= 512 } else { left > SMALL };
        let bytes = if split { rounded } else { extent };
        if split {
            self.free.insert(addr + rounded, left);
        }
        self.busy.insert(addr, bytes);
        Some(bytes)
    }

    /// The size of the block in use at `addr`, where known.
    pub fn busy(&self, addr: u64) -> Option<u64> {
        self.busy.get(&addr).copied()
    }

    /// A block done with (`free_completed`): free again, merged with its free neighbours.
    pub fn free_completed(&mut self, addr: u64) {
        if let Some(size) = self.busy.remove(&addr) {
            self.release(addr, size);
        }
    }

    fn release(&mut self, addr: u64, size: u64) {
        let Some((segment_start, segment_end)) = self.segment_of(addr) else { return };
        let (mut start, mut end) = (addr, addr + size);
        if let Some((&before, &before_size)) = self.free.range(segment_start..start).next_back() {
            if before + before_size == start {
                self.free.remove(&before);
                start = before;
            }
        }
        if end < segment_end {
            if let Some(after_size) = self.free.remove(&end) {
                end += after_size;
            }
        }
        self.free.insert(start, end - start);
    }

    /// The known segment holding `addr`: (start, end).
    fn segment_of(&self, addr: u64) -> Option<(u64, u64)> {
        let (&start, &end) = self.segments.range(..=addr).next_back()?;
        (addr < end).then_some((start, end))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn a_large_block_is_split_only_when_more_than_a_mebibyte_is_left_and_merges_back_when_done() {
        let mut layout = Layout::default();
        layout.segment(0, 20 * MIB);
        assert_eq!(layout.alloc(0, 4 * MIB), Some(4 * MIB), "16 MiB left: split");
        assert_eq!(layout.alloc(4 * MIB, 15 * MIB + 1), Some(16 * MIB), "under 1 MiB left: the whole rest");
        layout.free_completed(0);
        layout.free_completed(4 * MIB);
        assert_eq!(layout.alloc(0, 19 * MIB + 100), Some(20 * MIB), "the two merged back into the segment");
        layout.free_completed(0);
        assert_eq!(layout.alloc(0, 2 * MIB), Some(2 * MIB));
    }

    #[test]
    fn the_small_pool_splits_any_512_bytes_and_neighbours_in_other_segments_never_merge() {
        let mut layout = Layout::default();
        layout.segment(0, 2 * MIB);
        layout.segment(2 * MIB, 2 * MIB);
        assert_eq!(layout.alloc(0, MIB), Some(MIB));
        assert_eq!(layout.alloc(MIB, MIB - 512), Some(MIB - 512), "512 bytes left: split off");
        assert_eq!(layout.alloc(2 * MIB - 512, 100), Some(512));
        layout.free_completed(2 * MIB - 512);
        assert_eq!(layout.alloc(2 * MIB - 512, 512), Some(512), "not merged with the next segment's free start");
        assert_eq!(layout.alloc(2 * MIB, MIB), Some(MIB), "the next segment, split");
        assert_eq!(layout.alloc(3 * MIB + 512, 512), None, "no free block starts there");
    }

    #[test]
    fn the_opening_state_gives_blocks_in_use_their_size_and_free_ones_their_extent() {
        let block = |address, size, state| super::super::parse::SegmentBlock {
            address,
            size,
            requested_size: size,
            state,
            stack: 0,
        };
        let segment = Segment {
            device: 0,
            address: 0,
            total_size: 20 * MIB,
            stream: 0,
            segment_type: "large".into(),
            blocks: vec![
                block(0, 3 * MIB, BlockState::ActiveAllocated),
                block(3 * MIB, 17 * MIB, BlockState::Inactive),
            ],
        };
        let mut layout = Layout::opening(&[&segment]);
        assert_eq!(layout.busy(0), Some(3 * MIB));
        assert_eq!(layout.alloc(3 * MIB, 16 * MIB + 1), Some(17 * MIB));
        layout.free_completed(0);
        layout.free_completed(3 * MIB);
        assert_eq!(layout.alloc(0, 20 * MIB), Some(20 * MIB));
        layout.unmap(0, 20 * MIB);
        layout.free_completed(0);
        assert_eq!(layout.alloc(0, 512), None, "a segment given back is unknown");
    }
}
