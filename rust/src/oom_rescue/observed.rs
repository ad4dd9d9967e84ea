//! What torch's out-of-memory observer saw: torch calls its observers inside the allocator,
//! after it gave back the cached segments it could and before it raises, so the figures read
//! then are the failure's own. By the time the rescue runs (the cell's end) the exception has
//! unwound, and every temporary no name held (attention scores, an activation's intermediates,
//! a `torch.cat` being built) has been freed into the allocator's cache: read then, the figures
//! show the step's working memory as "reserved, unallocated" and look like fragmentation.
//!
//! The bindings attach one observer per process while the flight recorder runs
//! (`torch._C._cuda_attach_out_of_memory_observer`; torch keeps every observer attached, each
//! is called, and none can be detached). It reads the failing device's allocator figures with
//! one stats call and stores them here; it allocates nothing on the device.

use serde::Serialize;

use crate::fork::PerProcess;
pub use crate::report::PoolBytes;
use crate::trace::held::message_matches;

/// Torch's allocator at the failure, as the observer read it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Observed {
    pub torch_index: u32,
    /// The segment torch asked for (the size its message writes as "Tried to allocate").
    pub requested: u64,
    /// Torch's limit for the device: the memory fraction's cap where one is set, else the
    /// device's total.
    pub limit: u64,
    /// Free on the device, as the driver told torch at the failure.
    pub free: u64,
    pub allocated: PoolBytes,
    pub reserved: PoolBytes,
}

/// The latest failure the observer saw in this process, until a rescue takes it.
static LATEST: PerProcess<Option<Observed>> = PerProcess::new(|| None);

/// The observer saw a failure.
pub fn record(observed: Observed) {
    *LATEST.lock() = Some(observed);
}

/// The observer's figures for the failure torch's message names (its device, the size it asked
/// for): None where the observer saw none, or saw another (an OOM the user's code caught). Taken,
/// so that a later failure never reads them again.
pub fn take(device: Option<u32>, requested: Option<u64>) -> Option<Observed> {
    let observed = LATEST.lock().take()?;
    let same_device = device.is_none_or(|d| d == observed.torch_index);
    let same_size = requested.is_none_or(|asked| message_matches(observed.requested, asked));
    (same_device && same_size).then_some(observed)
}

/// The record is one per process: the tests that record or take it run one at a time.
#[cfg(test)]
pub(crate) static TESTS_ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[cfg(test)]
mod tests {
    use super::*;

    fn observed(torch_index: u32, requested: u64) -> Observed {
        Observed {
            torch_index,
            requested,
            limit: 0,
            free: 0,
            allocated: PoolBytes::default(),
            reserved: PoolBytes::default(),
        }
    }

    #[test]
    fn a_failure_is_taken_once_and_only_for_the_message_that_names_it() {
        const GIB: u64 = 1 << 30;
        let _alone = TESTS_ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        record(observed(1, 2 * GIB));
        assert_eq!(take(Some(1), Some(2 * GIB)), Some(observed(1, 2 * GIB)));
        assert_eq!(take(Some(1), Some(2 * GIB)), None, "taken");
        record(observed(1, 2 * GIB));
        assert_eq!(take(Some(0), Some(2 * GIB)), None, "another device's failure");
        record(observed(1, 2 * GIB));
        assert_eq!(take(Some(1), Some(4 * GIB)), None, "an earlier failure of another size");
        // "Tried to allocate 2.00 GiB" for a request torch rounded.
        record(observed(1, 2 * GIB + 3));
        assert!(take(Some(1), Some(2 * GIB)).is_some());
    }
}
