//! Ctrl-C, or Jupyter's interrupt button, held while gpuexp does work that must not stop
//! halfway: a teardown, an opening, the finder's cleanup. An interrupt that cut a teardown short
//! left memory held by `Out` and `_` and no report; held, it is raised once the work is done.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pyo3::exceptions::PyKeyboardInterrupt;
use pyo3::prelude::*;
use pyo3::types::PyCFunction;

/// SIGINT's handler replaced by one that only records, until [`Held::release`].
pub(in crate::bindings) struct HeldInterrupts<'py> {
    /// The `signal` module and the handler to put back; None where nothing was replaced:
    /// handlers can only be set from the main thread, and a non-Python handler is left alone.
    replaced: Option<(Bound<'py, PyAny>, Bound<'py, PyAny>)>,
    caught: Arc<AtomicBool>,
}

pub(in crate::bindings) fn hold(py: Python) -> HeldInterrupts {
    let caught = Arc::new(AtomicBool::new(false));
    let replaced = replace_handler(py, &caught).ok().flatten();
    HeldInterrupts { replaced, caught }
}

fn replace_handler<'py>(
    py: Python<'py>,
    caught: &Arc<AtomicBool>,
) -> PyResult<Option<(Bound<'py, PyAny>, Bound<'py, PyAny>)>> {
    if !on_main_thread(py)? {
        return Ok(None);
    }
    let signal = py.import("signal")?;
    let sigint = signal.getattr("SIGINT")?;
    let previous = signal.call_method1("getsignal", (&sigint,))?;
    if !previous.is_callable() {
        return Ok(None);
    }
    let flag = caught.clone();
    let recorder = PyCFunction::new_closure(py, None, None, move |_, _| flag.store(true, Ordering::SeqCst))?;
    signal.call_method1("signal", (&sigint, recorder))?;
    Ok(Some((signal.into_any(), previous)))
}

/// Whether the running code is on Python's main thread (where cells run and signals land).
pub(in crate::bindings) fn on_main_thread(py: Python) -> PyResult<bool> {
    let threading = py.import("threading")?;
    Ok(threading.call_method0("current_thread")?.is(&threading.call_method0("main_thread")?))
}

impl HeldInterrupts<'_> {
    /// Puts the handler back; returns whether an interrupt came while it was held.
    pub(in crate::bindings) fn release(self, py: Python) -> bool {
        if let Some((signal, previous)) = &self.replaced {
            // A signal that arrived since the last Python code ran is recorded now, not raised
            // by the handler put back.
            let _ = py.check_signals();
            if let Ok(sigint) = signal.getattr("SIGINT") {
                let _ = signal.call_method1("signal", (sigint, previous));
            }
        }
        self.caught.load(Ordering::SeqCst)
    }

    /// Runs `work` with the handler put back, so that the stop button stops it (work that may
    /// take long and can be dropped, such as reading tracemalloc's traces), then holds again.
    /// An interrupt that stops `work` counts as held: it is raised once the rest is done.
    pub(in crate::bindings) fn let_through<T>(&self, py: Python, work: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
        let Some((signal, previous)) = &self.replaced else { return work() };
        let swap = |handler: &Bound<PyAny>| -> PyResult<Bound<PyAny>> {
            let sigint = signal.getattr("SIGINT")?;
            let before = signal.call_method1("getsignal", (&sigint,))?;
            signal.call_method1("signal", (&sigint, handler))?;
            Ok(before)
        };
        // A signal that came before is the recorder's.
        let _ = py.check_signals();
        let recorder = swap(previous)?;
        let done = work();
        // Between the end of `work` and here, a signal waits unhandled: the recorder takes it.
        swap(&recorder)?;
        if done.as_ref().is_err_and(|e| e.is_instance_of::<PyKeyboardInterrupt>(py)) {
            self.caught.store(true, Ordering::SeqCst);
        }
        done
    }

    /// Puts the handler back and raises the interrupt if one came.
    pub(in crate::bindings) fn release_and_raise(self, py: Python) -> PyResult<()> {
        if self.release(py) {
            return Err(interrupted());
        }
        Ok(())
    }
}

pub(in crate::bindings) fn interrupted() -> PyErr {
    PyKeyboardInterrupt::new_err("gpuexp held this interrupt until its work was done")
}

/// Ctrl-C for long work (a snapshot's load): `check`, called as often as the work likes, runs
/// Python's signal handlers every 100 ms (taking the GIL back where the work released it: the
/// parse; the analysis holds it), and stops the work (`Error::Interrupted`) with the exception
/// they raised, which `error` gives back so that the very KeyboardInterrupt reaches the user.
pub(in crate::bindings) struct Interruptible {
    last: Instant,
    raised: Option<PyErr>,
}

impl Interruptible {
    const EVERY: Duration = Duration::from_millis(100);

    pub(in crate::bindings) fn new() -> Interruptible {
        Interruptible { last: Instant::now(), raised: None }
    }

    pub(in crate::bindings) fn check(&mut self) -> crate::error::Result<()> {
        if self.raised.is_some() {
            return Err(crate::error::Error::Interrupted);
        }
        if self.last.elapsed() < Self::EVERY {
            return Ok(());
        }
        self.last = Instant::now();
        Python::attach(|py| py.check_signals()).map_err(|raised| {
            self.raised = Some(raised);
            crate::error::Error::Interrupted
        })
    }

    /// The Python exception for `error`: the one a signal handler raised, where it stopped the work.
    pub(in crate::bindings) fn error(&mut self, error: crate::error::Error) -> PyErr {
        match (&error, self.raised.take()) {
            (crate::error::Error::Interrupted, Some(raised)) => raised,
            _ => error.into(),
        }
    }
}
