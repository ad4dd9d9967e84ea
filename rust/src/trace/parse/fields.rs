//! A field's number as the snapshot gives it, and the sizes no device could hold.

use crate::trace::pickle::Value;

/// The largest size a block, a segment or a request can have: no device holds a PiB, so a
/// larger one (or a negative one, or one past 64 bits) is nonsense, not a fact to show.
pub const MAX_SIZE: u64 = 1 << 50;

pub(super) fn int(value: &Value, key: &str) -> i64 {
    value.get(key).and_then(|v| v.as_int()).unwrap_or(0)
}

/// A size as the file gives it; None for one no device could hold (see `MAX_SIZE`), shown.
pub(super) fn size(value: &Value) -> std::result::Result<u64, String> {
    match value {
        Value::Int(n) if (0..=MAX_SIZE as i64).contains(n) => Ok(*n as u64),
        Value::Int(n) => Err(n.to_string()),
        Value::Opaque => Err("a number past 64 bits".into()),
        _ => Ok(0),
    }
}
