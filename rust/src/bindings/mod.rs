//! The Python module `gpuexp._core`: the only place that knows PyO3, in three folders by job:
//! `api/` (the module's faces: one file per family it exposes), `instrumentation/` (torch's
//! Python API reached from Rust) and `interpreter/` (the user's namespace, the heap, interrupts,
//! tracemalloc, forks). docs/ARCHITECTURE.md says which folder a new file goes in.

#[macro_use]
mod api; // first: its `report` defines `shown_as_table!`
mod instrumentation;
mod interpreter;

// Each family by its own name, for the export list below and for `crate::bindings::name` paths.
use api::report;
use api::{
    cell_log, compare, error, estimate, explain, files, finder, fit, holders, kernel, live_view, monitor, oom, ranks,
    recorder, running, scope, snapshot, status, trace, training, units, unreachable,
};
use instrumentation::{
    cell_trace, fakes, ledger_mode, rank_gpu, rngs, saved_step, step_state, torch, trace_opening, trace_recording,
    trace_sampling,
};
use interpreter::{fork, host_trace, hunt_roots, interrupts, namespace, python_heap, registry};

/// gpuexp's native core. The public API is the `gpuexp` package; see `_core.pyi` for types.
#[pyo3::pymodule(name = "_core")]
mod core_module {
    #[pymodule_export]
    use super::cell_log::{
        before_user_peak_reset, begin_cell, cell_grew, cell_log_active, cells, end_cell, set_standalone_log,
    };
    #[pymodule_export]
    use super::compare::{compare, ComparisonPy};
    #[pymodule_export]
    use super::error::{NoEstimate, NvmlUnavailable};
    #[pymodule_export]
    use super::estimate::{check_step, estimate, estimating, EstimatePy};
    #[pymodule_export]
    use super::explain::{explain, ExplanationPy};
    #[pymodule_export]
    use super::files::write_atomically;
    #[pymodule_export]
    use super::finder::{find_batch_size, BatchSizeResultPy};
    #[pymodule_export]
    use super::fit::{fit_accumulation, fit_checkpoint_plan, fit_report, FitPy};
    #[pymodule_export]
    use super::fork::{after_fork_in_child, is_forked_child};
    #[pymodule_export]
    use super::holders::holders;
    #[pymodule_export]
    use super::kernel::{config, history, history_json, shutdown};
    #[pymodule_export]
    use super::live_view::{live_view, live_view_stop, live_view_wait};
    #[pymodule_export]
    use super::monitor::MonitorPy;
    #[pymodule_export]
    use super::oom::rescue_oom;
    #[pymodule_export]
    use super::rank_gpu::default_device;
    #[pymodule_export]
    use super::ranks::{
        gather_ranks, host_ranks_store, kernel_ranks_store, last_publish_s, note_scope_error,
        remove_kernel_ranks_store, RanksPy,
    };
    #[pymodule_export]
    use super::recorder::{arm_recorder, mark_step};
    /// Completed steps after each cell's start (or experiment's opening) that the flight recorder
    /// records with torch's allocation history; later steps read a level at their end.
    #[pymodule_export]
    const RECORDER_HISTORY_STEPS: u32 = crate::recorder::HISTORY_STEPS;
    #[pymodule_export]
    use super::report::{
        report_from_json, CellRecordPy, GpuReportPy, HoldersPy, HostReportPy, MetricPy, OomPy, ReportPy, SnapshotPy,
    };
    #[pymodule_export]
    use super::running::{finish_cut_opening, finish_off_main_thread, owned_by, refuse_reopening, scope_entered};
    #[pymodule_export]
    use super::saved_step::{save_step, SavedStep};
    #[pymodule_export]
    use super::scope::{finish, is_open, keep, open_experiments, open_scope, scope_cells, scope_name, scope_report};
    #[pymodule_export]
    use super::snapshot::snapshot;
    #[pymodule_export]
    use super::status::{GpuStatusPy, WatchPy};
    #[pymodule_export]
    use super::trace::{load_snapshot, SiteDiffPy, TimelinePy, TracePy};
    #[pymodule_export]
    use super::training::{begin_run, note_run_error, run_batch, run_peaks, run_step, runs_in_flight};
    #[pymodule_export]
    use super::units::{parse_interval, parse_size};
    #[pymodule_export]
    use super::unreachable::{cell_ended_for_scopes, dropped, finish_unreachable, unreachable_waiting};

    /// The fork hook is registered at import, so that every later fork is known.
    #[pymodule_init]
    fn init(_module: &pyo3::Bound<'_, pyo3::types::PyModule>) -> pyo3::PyResult<()> {
        crate::fork::install();
        Ok(())
    }
}
