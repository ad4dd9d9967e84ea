//! The user's namespace as the adapter from `gpuexp.ipython` presents it (see the
//! `NamespaceAdapter` protocol in `_core.pyi`), and identity pins on what it held.

use std::collections::{HashMap, HashSet};

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyModule, PyString, PyWeakrefReference};

use crate::scope::Identities;
use crate::teardown::{self, Binding, Entry, NameState};

/// Remembers which object a name held, without keeping big objects alive: a weak reference
/// where the type allows one (tensors, arrays, modules), a strong one otherwise (ints, lists),
/// because an address alone can be reused by a new object after the old one is freed.
pub(in crate::bindings) enum Pin {
    Weak(Py<PyWeakrefReference>),
    Strong(Py<PyAny>),
}

impl Pin {
    pub(in crate::bindings) fn new(object: &Bound<PyAny>) -> Pin {
        match PyWeakrefReference::new(object) {
            Ok(weak) => Pin::Weak(weak.unbind()),
            Err(_) => Pin::Strong(object.clone().unbind()),
        }
    }

    pub(in crate::bindings) fn holds(&self, object: &Bound<PyAny>) -> bool {
        match self {
            Pin::Weak(weak) => weak.bind(object.py()).upgrade().is_some_and(|held| held.is(object)),
            Pin::Strong(held) => object.is(held),
        }
    }
}

pub(in crate::bindings) fn namespace<'py>(adapter: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyDict>>> {
    let namespace = adapter.getattr("namespace")?;
    if namespace.is_none() {
        return Ok(None);
    }
    Ok(Some(namespace.cast_into::<PyDict>()?))
}

pub(in crate::bindings) fn system_names(adapter: &Bound<PyAny>) -> PyResult<HashSet<String>> {
    adapter.call_method0("system_names")?.try_iter()?.map(|n| n?.extract()).collect()
}

pub(in crate::bindings) fn user_names<'py>(adapter: &Bound<'py, PyAny>) -> PyResult<Vec<(String, Bound<'py, PyAny>)>> {
    let Some(namespace) = namespace(adapter)? else { return Ok(Vec::new()) };
    let system = system_names(adapter)?;
    let mut names = Vec::with_capacity(namespace.len());
    for (key, value) in namespace.iter() {
        let Ok(name) = key.extract::<String>() else { continue };
        if !teardown::is_system_name(&name, &system) {
            names.push((name, value));
        }
    }
    Ok(names)
}

/// The user's names now, each with the identity of the object it holds: nothing is pinned.
pub(in crate::bindings) fn identities(adapter: &Bound<PyAny>) -> PyResult<Identities> {
    Ok(user_names(adapter)?.into_iter().map(|(name, value)| (name, value.as_ptr() as usize as u64)).collect())
}

/// The entries [`user_names`] leaves out (IPython's names, dunders, keys that are not plain
/// names), each with a label the report can show, in two: those IPython itself keeps now (the
/// adapter's `ipythons_own()`, by identity), and the others.
struct SkippedEntries<'py> {
    ipythons: Vec<(String, Bound<'py, PyAny>)>,
    others: Vec<(String, Bound<'py, PyAny>)>,
}

fn skipped_entries<'py>(adapter: &Bound<'py, PyAny>) -> PyResult<SkippedEntries<'py>> {
    let mut entries = SkippedEntries { ipythons: Vec::new(), others: Vec::new() };
    let Some(namespace) = namespace(adapter)? else { return Ok(entries) };
    let system = system_names(adapter)?;
    let own = adapter.call_method0("ipythons_own")?.cast_into::<PyDict>()?;
    for (key, value) in namespace.iter() {
        let label = match key.extract::<String>() {
            Ok(name) if !teardown::is_system_name(&name, &system) => continue,
            Ok(name) => name,
            // A surrogate or a non-string key: its repr names it.
            Err(_) => key.repr().map_or_else(|_| "?".into(), |r| r.to_string()),
        };
        let ipythons = own.get_item(&key).ok().flatten().is_some_and(|kept| kept.is(&value));
        if ipythons { &mut entries.ipythons } else { &mut entries.others }.push((label, value));
    }
    Ok(entries)
}

/// The keys of `namespace` whose text is `name` that are not plain strings, as the dict holds
/// them: a `str` subclass with its own `__hash__` is not found by a plain string of that text.
fn odd_keys_named<'py>(namespace: &Bound<'py, PyDict>, name: &str) -> Vec<Bound<'py, PyAny>> {
    let odd_named = |key: &Bound<PyAny>| {
        !key.is_exact_instance_of::<PyString>() && key.extract::<String>().is_ok_and(|text| text == name)
    };
    namespace.keys().iter().filter(odd_named).collect()
}

pub(in crate::bindings) fn hidden_refs<'py>(adapter: &Bound<'py, PyAny>) -> PyResult<Vec<(String, Bound<'py, PyAny>)>> {
    let refs = adapter.call_method0("hidden_refs")?.cast_into::<PyDict>()?;
    refs.iter().map(|(label, object)| Ok((label.extract()?, object))).collect()
}

fn pin_all(refs: Vec<(String, Bound<PyAny>)>) -> HashMap<String, Pin> {
    refs.into_iter().map(|(name, object)| (name, Pin::new(&object))).collect()
}

/// The namespace as a scope found it: what each name and hidden reference held, by identity,
/// and the experiment object itself (`exp.finish()` leaves `exp` usable).
pub(in crate::bindings) struct Baseline {
    adapter: Py<PyAny>,
    names: HashMap<String, Pin>,
    hidden: HashMap<String, Pin>,
    skipped: HashMap<String, Pin>,
    /// The entries IPython kept as its own: one a reset made IPython forget is not the scope's.
    ipythons: HashMap<String, Pin>,
    owner: Option<Pin>,
}

impl Baseline {
    pub(in crate::bindings) fn take(adapter: &Bound<PyAny>, owner: Option<&Bound<PyAny>>) -> PyResult<Baseline> {
        let skipped = skipped_entries(adapter)?;
        Ok(Baseline {
            names: pin_all(user_names(adapter)?),
            hidden: pin_all(hidden_refs(adapter)?),
            skipped: pin_all(skipped.others),
            ipythons: pin_all(skipped.ipythons),
            owner: owner.map(Pin::new),
            adapter: adapter.clone().unbind(),
        })
    }

    pub(in crate::bindings) fn adapter<'py>(&self, py: Python<'py>) -> Bound<'py, PyAny> {
        self.adapter.bind(py).clone()
    }

    /// The user's names now, each judged against what it held at the opening.
    pub(in crate::bindings) fn judged(&self, py: Python) -> PyResult<Vec<NameState>> {
        let names = user_names(self.adapter.bind(py))?;
        Ok(names
            .into_iter()
            .map(|(name, value)| NameState {
                binding: match self.names.get(&name) {
                    None => Binding::Created,
                    Some(pin) if pin.holds(&value) => Binding::Unchanged,
                    Some(_) => Binding::Rebound,
                },
                is_module: value.is_instance_of::<PyModule>(),
                is_owner: self.owner.as_ref().is_some_and(|owner| owner.holds(&value)),
                name,
            })
            .collect())
    }

    /// The user's names the scope created so far, the experiment's own name left out.
    pub(in crate::bindings) fn created(&self, py: Python) -> PyResult<Vec<String>> {
        let is_owner = |value: &Bound<PyAny>| self.owner.as_ref().is_some_and(|owner| owner.holds(value));
        let current = user_names(self.adapter.bind(py))?;
        Ok(current.into_iter().filter(|(n, v)| !self.names.contains_key(n) && !is_owner(v)).map(|(n, _)| n).collect())
    }
}

/// A scope's namespace at its teardown, judged against its baseline.
pub(in crate::bindings) struct NamespaceAtTeardown<'a, 'py> {
    pub(in crate::bindings) py: Python<'py>,
    pub(in crate::bindings) baseline: &'a Baseline,
}

impl NamespaceAtTeardown<'_, '_> {
    fn adapter(&self) -> Bound<'_, PyAny> {
        self.baseline.adapter(self.py)
    }
}

impl teardown::Namespace for NamespaceAtTeardown<'_, '_> {
    fn names(&self) -> Result<Vec<NameState>, String> {
        self.baseline.judged(self.py).map_err(|e| e.to_string())
    }

    fn delete(&mut self, name: &str) -> Result<(), String> {
        let deleted = || -> PyResult<Result<(), String>> {
            let Some(namespace) = namespace(&self.adapter())? else { return Ok(Ok(())) };
            if namespace.contains(name)? {
                namespace.del_item(name)?;
            }
            // Checked, never assumed: a key that hashes unlike its text survives `del` by name.
            for key in odd_keys_named(&namespace, name) {
                // Whether it went is checked below, and said in the report if it did not.
                namespace.del_item(&key).ok();
            }
            let left = odd_keys_named(&namespace, name);
            Ok(match left.first() {
                None => Ok(()),
                Some(key) => Err(format!(
                    "still bound after del: its key is a {} whose hash differs from its text's",
                    key.get_type().name().map_or_else(|_| "?".into(), |n| n.to_string())
                )),
            })
        };
        deleted().map_err(|e| e.to_string())?
    }

    fn left(&self) -> Result<Vec<Entry>, String> {
        let entries = skipped_entries(&self.adapter()).map_err(|e| e.to_string())?;
        let held = |pins: &HashMap<String, Pin>, label: &String, value: &Bound<PyAny>| {
            pins.get(label).is_some_and(|pin| pin.holds(value))
        };
        Ok(entries
            .others
            .into_iter()
            .filter(|(label, value)| !held(&self.baseline.skipped, label, value))
            .map(|(label, value)| Entry { ipythons_at_start: held(&self.baseline.ipythons, &label, &value), label })
            .collect())
    }

    fn changed_hidden(&self) -> Result<Vec<String>, String> {
        let refs = hidden_refs(&self.adapter()).map_err(|e| e.to_string())?;
        let unchanged = |label: &String, object: &Bound<PyAny>| {
            self.baseline.hidden.get(label).is_some_and(|pin| pin.holds(object))
        };
        Ok(refs.into_iter().filter(|(label, object)| !unchanged(label, object)).map(|(label, _)| label).collect())
    }

    fn drop_hidden(&mut self, label: &str) -> Result<(), String> {
        self.adapter().call_method1("drop_hidden", (label,)).map(drop).map_err(|e| e.to_string())
    }
}
