//! The fake side of an estimate, as the books see it: the real model's parameters, gradients and
//! buffers and its optimizers' state swapped for fake copies by `gpuexp.fake_step.Fakes` (torch
//! instrumentation, so Python), read by the ledger (`gpuexp.fake_step.LedgerRun`). They are
//! swapped into containers the estimate's state saving ([`crate::step_state`]) saved before, and
//! putting those back puts back the very objects; `restore` (or dropping this) puts back torch's
//! own settings.

use pyo3::prelude::*;
use pyo3::types::PyList;

/// Real tensors swapped for fake ones, until `restore`.
pub(in crate::bindings) struct Fakes<'py> {
    pub(in crate::bindings) py: Python<'py>,
    /// The `FakeTensorMode` that made every fake.
    pub(in crate::bindings) mode: Bound<'py, PyAny>,
    /// An attention module in eval mode was swapped: at inference the fast path would have run.
    pub(in crate::bindings) fastpath_skipped: bool,
    /// How many fakes were made for tensors on the `meta` device: they are not allocated now,
    /// and the ledger counts them as loaded before the step.
    pub(in crate::bindings) loaded: usize,
    /// The `gpuexp.fake_step.Fakes`, which the ledger reads.
    pub(in crate::bindings) swapped: Bound<'py, PyAny>,
}

impl<'py> Fakes<'py> {
    /// Swaps the tensors of `owners` (modules and optimizers) for fakes; `target` is the
    /// `torch.device` the estimate is for. On an error nothing stays swapped.
    pub(in crate::bindings) fn swap_in(
        py: Python<'py>,
        owners: &[Bound<'py, PyAny>],
        target: Bound<'py, PyAny>,
    ) -> PyResult<Fakes<'py>> {
        let swapped = py.import("gpuexp.fake_step")?.getattr("Fakes")?.call1((PyList::new(py, owners)?, target))?;
        Ok(Fakes {
            py,
            mode: swapped.getattr("mode")?,
            fastpath_skipped: swapped.getattr("fastpath_skipped")?.extract()?,
            loaded: swapped.getattr("from_meta")?.len()?,
            swapped,
        })
    }

    /// Puts back torch's settings (the real tensors come back with the saved state); safe to call twice.
    pub(in crate::bindings) fn restore(&mut self) -> PyResult<()> {
        self.swapped.call_method0("restore").map(drop)
    }
}

impl Drop for Fakes<'_> {
    fn drop(&mut self) {
        let _ = self.restore();
    }
}
