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

use super::parse::Segment;

/// The allocator's state when the recording began.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Opening {
    /// When it was taken, in Unix microseconds (torch's `time_us` clock): just before the first event.
    pub time_us: i64,
    /// The ring buffer's cap the recording started with: a trace that long may have wrapped,
    /// and then the opening state no longer precedes its first event.
    pub max_entries: Option<usize>,
    pub segments: Vec<Segment>,
}

/// The traced experiment a saved snapshot comes from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Window {
    /// When the experiment opened (Unix microseconds): its peak is from then on.
    pub opened_us: i64,
    pub max_entries: Option<usize>,
    /// (torch index, `max_memory_allocated` over the experiment) for each GPU it traced.
    pub peaks: Vec<(usize, u64)>,
}

/// The `gpuexp` key of a snapshot: absent from torch's own files.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Gpuexp {
    pub opening: Option<Opening>,
    pub window: Option<Window>,
}

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
