//! The buffers a hunt counts: a tensor's storage, an array that owns its data.

use pyo3::prelude::*;

use crate::holders_walk::{Buffer, Memory, Piece};

/// A tensor's storage if it lives in `memory`.
pub(in crate::bindings) fn tensor_piece(tensor: &Bound<PyAny>, memory: &Memory) -> PyResult<Option<Piece>> {
    let device = tensor.getattr("device")?;
    let kind: String = device.getattr("type")?.extract()?;
    let index: Option<u32> = device.getattr("index")?.extract()?;
    let wanted = match memory {
        Memory::Cuda(want) => kind == "cuda" && index.unwrap_or(0) == *want,
        Memory::Host => kind == "cpu",
        Memory::Any => true,
    };
    if !wanted {
        return Ok(None);
    }
    let storage = tensor.call_method0("untyped_storage")?;
    let pointer: usize = storage.call_method0("data_ptr")?.extract()?;
    let bytes: u64 = storage.call_method0("nbytes")?.extract()?;
    if pointer == 0 || bytes == 0 {
        return Ok(None);
    }
    Ok(Some(Piece {
        buffer: Buffer::Storage(pointer),
        bytes,
        kind: "tensor",
        shape: tensor.getattr("shape").map(|s| shape_text(&s)).unwrap_or_default(),
        device: match index {
            Some(i) => format!("{kind}:{i}"),
            None => kind,
        },
    }))
}

pub(super) fn array_piece(array: &Bound<PyAny>) -> Piece {
    Piece {
        buffer: Buffer::Array(array.as_ptr() as usize),
        bytes: array.getattr("nbytes").and_then(|b| b.extract::<u64>()).unwrap_or(0),
        kind: "ndarray",
        shape: array.getattr("shape").map(|s| shape_text(&s)).unwrap_or_default(),
        device: "cpu".into(),
    }
}

pub(super) fn shape_text(shape: &Bound<PyAny>) -> String {
    let dims: Vec<i64> = shape.extract().unwrap_or_default();
    format!("[{}]", dims.iter().map(i64::to_string).collect::<Vec<_>>().join(", "))
}
