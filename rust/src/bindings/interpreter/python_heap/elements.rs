//! Containers that give the collector no referents, read element by element through their
//! owners' public accessors: a NumPy object array through `flat`, a pandas Series through
//! `items()`, a DataFrame's object columns through `dtypes` and `iloc`. pandas' internals (its
//! blocks, in Cython) are never read, so a path is what the user would write: `arr[0]`,
//! `df['emb'][3]`. Each container gives at most the core's `ELEMENTS_READ` elements; where it
//! holds more, `unread` says how many, for the report's note.

use pyo3::prelude::*;
use pyo3::types::PySlice;

use super::PythonHeap;
use crate::holders_walk::{Edge, Name, Refs, ELEMENTS_READ};

/// Which pandas container a class is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Table {
    Series,
    DataFrame,
}

/// Whether a NumPy or pandas dtype stores Python objects (an extension dtype never does).
fn holds_objects(dtype: &Bound<PyAny>) -> bool {
    dtype.getattr("hasobject").and_then(|has| has.is_truthy()).unwrap_or(false)
}

impl<'py> PythonHeap<'py> {
    /// Notes that a container of `elements` gave only the first `ELEMENTS_READ` of them.
    fn read_at_most(&mut self, elements: usize) {
        if elements > ELEMENTS_READ {
            self.unread = Some(elements as u64);
        }
    }

    /// An object array's elements, through numpy's own `flat`: `arr[3]`, or `grid.flat[5]` where
    /// it has more than one dimension.
    pub(super) fn object_array_elements(
        &mut self,
        array: &Bound<'py, PyAny>,
        refs: &mut Refs<Bound<'py, PyAny>>,
    ) -> PyResult<()> {
        if !holds_objects(&array.getattr("dtype")?) {
            return Ok(());
        }
        let one_dimensional = array.getattr("ndim")?.extract::<usize>()? == 1;
        for (i, item) in array.getattr("flat")?.try_iter()?.take(ELEMENTS_READ).enumerate() {
            let edge = if one_dimensional { Edge::Index(i) } else { Edge::Attr(Name::Text(format!("flat[{i}]"))) };
            self.add(refs, edge, item?);
        }
        self.read_at_most(array.getattr("size")?.extract()?);
        Ok(())
    }

    /// A pandas Series or DataFrame, by what the user would index it with.
    pub(super) fn table_elements(
        &mut self,
        table: Table,
        object: &Bound<'py, PyAny>,
        refs: &mut Refs<Bound<'py, PyAny>>,
    ) -> PyResult<()> {
        match table {
            Table::Series => self.series_elements(object, refs),
            Table::DataFrame => self.frame_columns(object, refs),
        }
    }

    /// An object Series's elements by their labels (`s[3]`, `s['a']`), through `items()`.
    fn series_elements(&mut self, series: &Bound<'py, PyAny>, refs: &mut Refs<Bound<'py, PyAny>>) -> PyResult<()> {
        if !holds_objects(&series.getattr("dtype")?) {
            return Ok(());
        }
        for pair in series.call_method0("items")?.try_iter()?.take(ELEMENTS_READ) {
            let (label, value): (Bound<PyAny>, Bound<PyAny>) = pair?.extract()?;
            self.add(refs, Edge::Key(label), value);
        }
        self.read_at_most(series.len()?);
        Ok(())
    }

    /// A DataFrame's object columns, each as the Series `df['emb']` gives, by position through
    /// `iloc`: `df[...]` would fill the frame's column cache (pandas 2).
    fn frame_columns(&mut self, frame: &Bound<'py, PyAny>, refs: &mut Refs<Bound<'py, PyAny>>) -> PyResult<()> {
        let iloc = frame.getattr("iloc")?;
        let every_row = PySlice::full(frame.py());
        for (position, pair) in frame.getattr("dtypes")?.call_method0("items")?.try_iter()?.enumerate() {
            let (label, dtype): (Bound<PyAny>, Bound<PyAny>) = pair?.extract()?;
            if holds_objects(&dtype) {
                let column = iloc.get_item((every_row.clone(), position))?;
                self.add(refs, Edge::Key(label), column);
            }
        }
        Ok(())
    }
}
