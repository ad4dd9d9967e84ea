//! What gpuexp adds to a torch snapshot so that its replay is exact, under the top-level key
//! `gpuexp` (memory_viz and Mosaic read only `segments` and `device_traces`, so they still open
//! the file):
//!
//! - `opening`: the allocator's segments, every block in them with its exact size, taken just
//!   before gpuexp started the recording (a state-only snapshot, history off: about 0.2 ms).
//!   A block allocated before the recording and freed during it then has its size, not one
//!   inferred from what was asked for; and each free block's extent tells how torch splits it.
//! - `window`: the traced experiment the file was saved from: when it opened, the ring
//!   buffer's cap, and torch's own `max_memory_allocated` over it on each GPU (the true peak
//!   the replay must meet).
//!
//! The key's types are the parsed snapshot's (`parse/`, read by `parse/gpuexp_key.rs`); what they
//! tell the replay is here.

use super::parse::{Gpuexp, Segment};

impl Gpuexp {
    /// Torch's own peak over the window on `device`, where the file carries it.
    pub fn true_peak(&self, device: usize) -> Option<u64> {
        self.window.as_ref()?.peaks.iter().find(|(d, _)| *d == device).map(|(_, bytes)| *bytes)
    }

    /// The opening state of `device`'s segments, where it precedes a trace of `events` events
    /// that did not wrap (`max_entries`: the cap, where the caller knows it better).
    pub fn opening_of(&self, device: usize, events: usize, max_entries: Option<usize>) -> Option<Vec<&Segment>> {
        let opening = self.opening.as_ref()?;
        let cap = max_entries.or(opening.max_entries);
        if cap.is_some_and(|cap| events >= cap) {
            return None;
        }
        Some(opening.segments.iter().filter(|segment| segment.device == device).collect())
    }
}
