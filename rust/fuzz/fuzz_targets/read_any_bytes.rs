// What the fuzz target runs on each input. `rust/tests/snapshot_bytes.rs` includes this file
// too, so that CI's stable build compiles (and its property tests run) the fuzzed code itself:
// the fuzz target is built only on nightly, where a renamed item once went unnoticed.

/// Reads any bytes as `load_snapshot` does: a snapshot or a clean error, never a panic.
pub fn read_any_bytes(bytes: &[u8]) {
    let _ = gpuexp_core::trace::AllocationHistory::from_pickle(bytes);
}
