//! What a pickle refers back to: the memo (PUT and GET, by index), the containers it referred to
//! more than once (emptied at the end, so a container put inside itself is freed), and the
//! containers the hook has read, which read as their ids from the memo on.

use std::collections::HashMap;
use std::rc::Rc;

use super::value::{Value, NO_SLOT};

/// The lists and dicts that the pickle referred to more than once. Only through one of them
/// can a container end up inside itself (`]q\x00h\x00a`: a list appended to itself), which
/// reference counting never frees; emptied when the read is done with, that cycle is broken.
#[derive(Default)]
pub(super) struct Shared(Vec<Value>);

impl Shared {
    pub(super) fn note(&mut self, value: &Value) {
        let shared = match value {
            Value::List(list) => &list.shared,
            Value::Dict(dict) => &dict.shared,
            _ => return,
        };
        if !shared.replace(true) {
            self.0.push(value.clone());
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        for container in &self.0 {
            match container {
                Value::List(list) => drop(list.items.take()),
                Value::Dict(dict) => drop(dict.items.take()),
                _ => {}
            }
        }
    }
}

/// A container's memo slot, if it was memoized.
pub(super) fn slot(value: &Value) -> Option<usize> {
    let slot = match value {
        Value::List(list) => list.slot.get(),
        Value::Dict(dict) => dict.slot.get(),
        _ => NO_SLOT,
    };
    (slot != NO_SLOT).then_some(slot as usize)
}

fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::List(a), Value::List(b)) => Rc::ptr_eq(a, b),
        (Value::Dict(a), Value::Dict(b)) => Rc::ptr_eq(a, b),
        _ => false,
    }
}

/// The memo: indices as Python's pickler writes them (0, 1, 2...) in a vector, any other in a
/// map, so that an index a file chose (4294967294, in a 9-byte file) costs one entry, not a
/// vector that long.
#[derive(Default)]
pub(super) struct Memo {
    dense: Vec<Value>,
    sparse: HashMap<usize, Value>,
}

impl Memo {
    pub(super) fn set(&mut self, index: usize, value: Value) {
        if let Some(entry) = self.dense.get_mut(index) {
            *entry = value;
        } else if index == self.dense.len() {
            self.dense.push(value);
        } else {
            self.sparse.insert(index, value);
        }
    }

    pub(super) fn get(&self, index: usize) -> Option<&Value> {
        self.dense.get(index).or_else(|| self.sparse.get(&index))
    }

    fn get_mut(&mut self, index: usize) -> Option<&mut Value> {
        self.dense.get_mut(index).or_else(|| self.sparse.get_mut(&index))
    }

    /// The index MEMOIZE gives the next entry.
    pub(super) fn next(&self) -> usize {
        self.dense.len() + self.sparse.len()
    }
}

/// The containers in `read` read as their ids from now on.
pub(super) fn settle(read: &mut Vec<(Value, u32)>, memo: &mut Memo) {
    for (container, id) in read.drain(..) {
        match &container {
            Value::List(list) => list.kept.set(Some(id)),
            Value::Dict(dict) => dict.kept.set(Some(id)),
            _ => continue,
        }
        read_as(memo, &container, id);
    }
}

/// `container`, read by the hook as `id`, reads so from the memo on: its items are gone.
pub(super) fn read_as(memo: &mut Memo, container: &Value, id: u32) {
    if let Some(entry) = slot(container).and_then(|slot| memo.get_mut(slot)) {
        if same(entry, container) {
            *entry = match container {
                Value::List(_) => Value::ReadList(id),
                _ => Value::ReadDict(id),
            };
        }
    }
}
