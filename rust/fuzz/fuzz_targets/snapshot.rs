//! Any bytes, as `load_snapshot` reads them: a snapshot or a clean error, never a panic, an
//! abort, a stack overflow, or memory and time past libFuzzer's limits (`make fuzz` sets them).
#![no_main]

use libfuzzer_sys::fuzz_target;

include!("read_any_bytes.rs");

fuzz_target!(|bytes: &[u8]| read_any_bytes(bytes));
