//! An `lru_cache`'s entries, which it keeps in C, out of `__dict__`.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple, PyType};

use super::PythonHeap;
use crate::holders_walk::{Edge, Heap, Refs};

impl<'py> PythonHeap<'py> {
    /// An `lru_cache` keeps its entries in C, out of `__dict__`. `gc.get_referents` reports them:
    /// an unbounded cache (`functools.cache`) its dict of key → result; a bounded one each
    /// entry's key then result, and a dict whose values are the list's links. The wrapper's
    /// type, marks and own attributes are set aside by identity, which holds on CPython 3.9+.
    pub(super) fn look_lru_cache(
        &mut self,
        wrapper: &Bound<'py, PyAny>,
        refs: &mut Refs<Bound<'py, PyAny>>,
    ) -> PyResult<()> {
        let own = wrapper.getattr("__dict__")?;
        let wrapped = own.get_item("__wrapped__").ok();
        let mut rest: Vec<Bound<PyAny>> = Vec::new();
        for referent in self.get_referents.call1((wrapper,))?.cast::<PyList>()?.iter() {
            let set_aside = referent.is_instance_of::<PyType>()
                || referent.get_type().is(&self.object_type)
                || referent.is(&own)
                || wrapped.as_ref().is_some_and(|w| referent.is(w));
            if !set_aside {
                rest.push(referent);
            }
        }
        let is_links = |d: &Bound<PyAny>| {
            d.cast::<PyDict>().is_ok_and(|d| {
                d.values().iter().next().is_some_and(|v| v.get_type().name().is_ok_and(|n| n == "_lru_list_elem"))
            })
        };
        rest.retain(|referent| !is_links(referent));
        match rest.as_slice() {
            [cache] if cache.is_instance_of::<PyDict>() => {
                for (key, result) in cache.cast::<PyDict>()?.iter() {
                    self.add(refs, Edge::CacheEntry(key), result);
                }
            }
            pairs if pairs.len() % 2 == 0 => {
                for pair in pairs.chunks(2) {
                    self.add(refs, Edge::CacheEntry(pair[0].clone()), pair[1].clone());
                }
            }
            unpaired => {
                for referent in unpaired {
                    self.add(refs, Edge::Referent("lru_cache".into()), referent.clone());
                }
            }
        }
        self.add_items(refs, &own, false)
    }

    /// An `lru_cache` key as the call that made it: `(268435456,)`, `(2, k=3)`.
    pub(super) fn cache_call(&self, key: &Bound<'py, PyAny>) -> String {
        let Ok(args) = key.cast::<PyTuple>() else { return format!("({},)", self.short(key)) };
        // Keyword arguments follow a mark (a bare `object()`), as name, value, name, value.
        let items: Vec<Bound<PyAny>> = args.iter().collect();
        let mark = items.iter().position(|item| item.get_type().is(&self.object_type)).unwrap_or(items.len());
        let mut words: Vec<String> = items[..mark].iter().map(|item| self.short(item)).collect();
        for pair in items.get(mark + 1..).unwrap_or_default().chunks(2) {
            if let [name, value] = pair {
                words.push(format!("{}={}", self.text(name), self.short(value)));
            }
        }
        match words.len() {
            1 if mark == 1 => format!("({},)", words[0]),
            _ => format!("({})", words.join(", ")),
        }
    }
}
