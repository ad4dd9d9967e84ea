//! Any bytes, as `load_snapshot` reads them: a snapshot or a clean error, never a panic, an
//! abort, a stack overflow, or memory and time past libFuzzer's limits (`make fuzz` sets them).
#![no_main]

use gpuexp_core::trace::Snapshot;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    let _ = Snapshot::from_pickle(bytes);
});
