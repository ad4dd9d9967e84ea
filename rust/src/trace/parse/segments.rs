//! The allocator's segments and their blocks as the snapshot gives them (at its end, and in the
//! `gpuexp` key's opening), each charged to the budget and its sizes checked.

use super::builder::Builder;
use super::fields::int;
use super::{BlockState, Segment, SegmentBlock};
use crate::trace::pickle::Value;

impl Builder<'_> {
    /// A segment and its blocks, none once the budget is spent.
    pub(super) fn segment(&mut self, dict: &Value) -> Option<Segment> {
        if !self.budget.charge(1 + dict.item_count()) {
            return None;
        }
        let blocks = dict.get("blocks").unwrap_or(Value::None);
        let blocks = if self.budget.charge(blocks.item_count()) { blocks.items() } else { Vec::new() };
        let segment_type = dict.get("segment_type");
        let address = int(dict, "address") as u64;
        let segment = move || format!("the segment at address {address:#x}");
        let total_size = dict.get("total_size").map_or(0, |found| self.size(&found, "total_size", segment));
        Some(Segment {
            device: int(dict, "device").max(0) as usize,
            address,
            total_size,
            stream: int(dict, "stream"),
            segment_type: segment_type.as_ref().and_then(Value::as_str).unwrap_or("").to_string(),
            blocks: blocks.iter().map_while(|block| self.block(block, &segment)).collect(),
        })
    }

    /// A segment's block, none once the budget is spent.
    fn block(&mut self, block: &Value, segment: &dyn Fn() -> String) -> Option<SegmentBlock> {
        if !self.budget.charge(1 + block.item_count()) || !self.budget.hold(std::mem::size_of::<SegmentBlock>()) {
            return None;
        }
        let at = int(block, "address") as u64;
        let what = || format!("the block at address {at:#x} of {}", segment());
        let size = block.get("size").map_or(0, |found| self.size(&found, "size", what));
        let requested_size = block.get("requested_size").map_or(0, |found| self.size(&found, "requested_size", what));
        let state = block.get("state");
        Some(SegmentBlock {
            address: at,
            size,
            requested_size,
            state: match state.as_ref().and_then(Value::as_str) {
                Some("active_allocated") => BlockState::ActiveAllocated,
                Some("active_pending_free") => BlockState::ActivePendingFree,
                _ => BlockState::Inactive,
            },
            stack: self.stack(block.get("frames").as_ref()),
        })
    }
}
