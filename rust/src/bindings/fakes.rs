//! The fake side of an estimate, as the books see it: the real model's parameters, gradients and
//! buffers and its optimizers' state swapped for fake copies by `gpuexp.fake_step.Fakes` (torch
//! instrumentation, so Python), read here once for the ledger (`ledger_mode`); everything swapped
//! is put back, the very objects, when `restore` runs or this is dropped.

use std::collections::HashSet;

use pyo3::prelude::*;
use pyo3::types::{PyList, PyType};

/// Real tensors swapped for fake ones, until `restore`.
pub(super) struct Fakes<'py> {
    pub(super) py: Python<'py>,
    pub(super) torch: Bound<'py, PyAny>,
    /// The `FakeTensorMode` that made every fake.
    pub(super) mode: Bound<'py, PyAny>,
    pub(super) tensor: Bound<'py, PyType>,
    pub(super) fake_tensor: Bound<'py, PyType>,
    pub(super) params: Vec<Bound<'py, PyAny>>,
    pub(super) buffers: Vec<Bound<'py, PyAny>>,
    pub(super) optimizers: Vec<Bound<'py, PyAny>>,
    /// An attention module in eval mode was swapped: at inference the fast path would have run.
    pub(super) fastpath_skipped: bool,
    /// Fakes made for tensors on the `meta` device, by address: they are not allocated now, and
    /// the ledger counts them as loaded before the step.
    pub(super) from_meta: HashSet<usize>,
    swapped: Bound<'py, PyAny>,
}

impl<'py> Fakes<'py> {
    /// Swaps the tensors of `owners` (modules and optimizers) for fakes; `target` is the
    /// `torch.device` the estimate is for. On an error nothing stays swapped.
    pub(super) fn swap_in(
        py: Python<'py>,
        owners: &[Bound<'py, PyAny>],
        target: Bound<'py, PyAny>,
    ) -> PyResult<Fakes<'py>> {
        let swapped = py.import("gpuexp.fake_step")?.getattr("Fakes")?.call1((PyList::new(py, owners)?, target))?;
        let list = |name: &str| -> PyResult<Vec<Bound<'py, PyAny>>> { swapped.getattr(name)?.extract() };
        Ok(Fakes {
            py,
            torch: py.import("sys")?.getattr("modules")?.get_item("torch")?,
            mode: swapped.getattr("mode")?,
            tensor: swapped.getattr("tensor")?.cast_into()?,
            fake_tensor: swapped.getattr("fake_tensor")?.cast_into()?,
            params: list("params")?,
            buffers: list("buffers")?,
            optimizers: list("optimizers")?,
            fastpath_skipped: swapped.getattr("fastpath_skipped")?.extract()?,
            // `id()` is the address in CPython.
            from_meta: swapped.getattr("from_meta")?.extract()?,
            swapped,
        })
    }

    /// Puts back every real tensor, state and param group, and torch's settings; safe to call twice.
    pub(super) fn restore(&mut self) -> PyResult<()> {
        self.swapped.call_method0("restore").map(drop)
    }
}

impl Drop for Fakes<'_> {
    fn drop(&mut self) {
        let _ = self.restore();
    }
}
