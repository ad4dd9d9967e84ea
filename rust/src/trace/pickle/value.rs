//! The values a pickle is read into: 16 bytes each, cloned by a reference count, its lists and
//! dicts `Container`s that carry their memo slot and the hook's notes (so finding them is a field
//! away, not a hash lookup), and a drop that frees deep nesting without recursing.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

/// A list or dict being read, with what the reader and the hook note about it.
#[derive(Debug)]
pub struct Container<T> {
    pub(super) items: RefCell<Vec<T>>,
    /// Where it was last memoized (`NO_SLOT` if never), so a read one can leave the memo.
    pub(super) slot: Cell<u32>,
    /// The hook's number for it (what it was read as), set once the hook has read it.
    pub note: Cell<Option<u32>>,
    /// What the hook read it as when it was filled (`Finish::finish_dict`, `finish_list`).
    pub(super) kept: Cell<Option<u32>>,
    /// Referred to a second time (DUP, GET): it may be inside itself (`Shared`).
    pub(super) shared: Cell<bool>,
}

pub(super) const NO_SLOT: u32 = u32::MAX;

impl<T> Default for Container<T> {
    fn default() -> Container<T> {
        Container {
            items: RefCell::new(Vec::new()),
            slot: Cell::new(NO_SLOT),
            note: Cell::new(None),
            kept: Cell::new(None),
            shared: Cell::new(false),
        }
    }
}

impl<T> Container<T> {
    pub fn borrow(&self) -> std::cell::Ref<'_, Vec<T>> {
        self.items.borrow()
    }
}

pub type List = Rc<Container<Value>>;
pub type Dict = Rc<Container<(Value, Value)>>;

/// 16 bytes: every memo entry and stack slot is one, and a large trace has tens of millions.
#[derive(Clone, Debug)]
pub enum Value {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(Rc<Box<str>>),
    Bytes,
    List(List),
    Dict(Dict),
    Tuple(Rc<Vec<Value>>),
    /// A class, a call's result, a persistent id: never evaluated.
    Opaque,
    /// A dict the hook read whole as it was filled (`Finish::finish_dict`), as what the hook
    /// keeps at this index: its memo entry once read.
    ReadDict(u32),
    /// The same for a list (`Finish::finish_list`).
    ReadList(u32),
    /// List items the hook made compact: `first..first + count` of what the hook keeps (a run
    /// of them is one value, so a trace's list costs next to nothing).
    Kept {
        first: u32,
        count: u32,
    },
}

impl Value {
    pub fn as_int(&self) -> Option<i64> {
        match self {
            Value::Int(n) => Some(*n),
            Value::Bool(b) => Some(*b as i64),
            Value::Float(f) if f.fract() == 0.0 => Some(*f as i64),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(text) => Some(text),
            _ => None,
        }
    }

    /// `key`'s value when this is a dict with string keys.
    pub fn get(&self, key: &str) -> Option<Value> {
        let Value::Dict(dict) = self else { return None };
        dict.borrow().iter().find(|(k, _)| k.as_str() == Some(key)).map(|(_, v)| v.clone())
    }

    /// Calls `each` with every string key and its value, when this is a dict.
    pub fn for_each_entry(&self, mut each: impl FnMut(&str, &Value)) {
        if let Value::Dict(dict) = self {
            for (key, value) in dict.borrow().iter() {
                if let Value::Str(key) = key {
                    each(key, value);
                }
            }
        }
    }

    /// What the hook read this dict as when it was filled, if it did.
    pub fn read_dict(&self) -> Option<u32> {
        match self {
            Value::ReadDict(id) => Some(*id),
            Value::Dict(dict) => dict.kept.get(),
            _ => None,
        }
    }

    /// What the hook read this list as when it was filled, if it did.
    pub fn read_list(&self) -> Option<u32> {
        match self {
            Value::ReadList(id) => Some(*id),
            Value::List(list) => list.kept.get(),
            _ => None,
        }
    }

    /// How many items a list or tuple has, or entries a dict (0 for anything else).
    pub fn item_count(&self) -> usize {
        match self {
            Value::List(list) => list.borrow().len(),
            Value::Dict(dict) => dict.borrow().len(),
            Value::Tuple(items) => items.len(),
            _ => 0,
        }
    }

    /// The items of a list or tuple.
    pub fn items(&self) -> Vec<Value> {
        match self {
            Value::List(list) => list.borrow().clone(),
            Value::Tuple(items) => items.as_ref().clone(),
            _ => Vec::new(),
        }
    }
}

/// Frees nested containers with a loop, not a recursion: a million tuples one inside the next
/// (a 1 MB file) would otherwise overflow the stack as the outermost is dropped. A container
/// that something else still refers to is left alone (only its count drops).
impl Drop for Value {
    fn drop(&mut self) {
        let mut nested = Vec::new();
        take_items(self, &mut nested);
        while let Some(mut value) = nested.pop() {
            take_items(&mut value, &mut nested);
        }
    }
}

/// Moves the items of `value`, when it is the last reference to a container, into `nested`,
/// those that hold items themselves (the rest are dropped here, with nothing under them).
fn take_items(value: &mut Value, nested: &mut Vec<Value>) {
    let holds_items = |value: &Value| match value {
        Value::List(list) => Rc::strong_count(list) == 1 && !list.borrow().is_empty(),
        Value::Dict(dict) => Rc::strong_count(dict) == 1 && !dict.borrow().is_empty(),
        Value::Tuple(items) => Rc::strong_count(items) == 1 && !items.is_empty(),
        _ => false,
    };
    match value {
        Value::List(list) => {
            if let Some(list) = Rc::get_mut(list) {
                nested.extend(list.items.get_mut().drain(..).filter(holds_items));
            }
        }
        Value::Dict(dict) => {
            if let Some(dict) = Rc::get_mut(dict) {
                let pairs = dict.items.get_mut().drain(..);
                nested.extend(pairs.flat_map(|(key, value)| [key, value]).filter(holds_items));
            }
        }
        Value::Tuple(items) => {
            if let Some(items) = Rc::get_mut(items) {
                nested.extend(items.drain(..).filter(holds_items));
            }
        }
        _ => {}
    }
}
