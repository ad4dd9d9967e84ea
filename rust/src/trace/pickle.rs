//! A reader for pickles of plain data (dicts, lists, tuples, strings, numbers), protocols 2 to
//! 5. It runs no code: a class or a call in the file becomes an opaque value, never an import.
//! Memoized objects are shared, not copied (torch's snapshots share each frame dict among every
//! stack that has it, and each frames list among the events and blocks of one traceback), and
//! a `Finish` hook reads containers into something compact as soon as they are filled, so a
//! large trace is never held as a tree of dicts.
//!
//! Speed and memory (a 1 GiB snapshot is some 400 million opcodes): a value is 16 bytes and
//! cloned by a reference count. A dict or list that the hook reads whole as its items are set
//! (an event, a frames list) never stores them, and its memo entry becomes `ReadDict(id)` or
//! `ReadList(id)`, 16 bytes, so a later reference to it still reads the same (as does one the
//! hook read along with its event). A container carries its own memo slot and
//! a note for the hook, so that and finding a frame already read are a field away, not a hash
//! lookup. A list of kept items holds them as runs (`Kept`), a trace's list as one value.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

/// A list or dict being read, with what the reader and the hook note about it.
#[derive(Debug)]
pub struct Container<T> {
    items: RefCell<Vec<T>>,
    /// Where it was last memoized (`NO_SLOT` if never), so a read one can leave the memo.
    slot: Cell<u32>,
    /// The hook's number for it (what it was read as), set once the hook has read it.
    pub note: Cell<Option<u32>>,
    /// What the hook read it as when it was filled (`Finish::finish_dict`, `finish_list`).
    kept: Cell<Option<u32>>,
    /// Referred to a second time (DUP, GET): it may be inside itself (`Shared`).
    shared: Cell<bool>,
}

const NO_SLOT: u32 = u32::MAX;

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

/// What the reader does with containers as they are filled: read them into something compact
/// (an index into what the hook keeps), or leave them be.
pub trait Finish {
    /// An item as it is appended to a list: itself, or `Kept` (one item, `count` 1). A dict
    /// made `Kept` then reads so (`ReadDict`) wherever it is referred to again. Containers
    /// the hook read whole along with it (an event's frames list, as its stack) go in `read`
    /// with their ids, and read so from then on too (`ReadList`, `ReadDict`).
    fn finish(&mut self, item: Value, read: &mut Vec<(Value, u32)>) -> Value;

    /// A new dict's items (key, value, key, value...), all of them, as they are set: with
    /// `Some(n)` the dict reads as `n` (`Value::read_dict`; appended to a list, it is `Kept`
    /// item `n`) and its items are never stored; `read` as in `finish`. Most of a trace is its event dicts, so they
    /// are read here, never built.
    fn finish_dict(&mut self, _items: &[Value], _read: &mut Vec<(Value, u32)>) -> Option<u32> {
        None
    }

    /// A new list's items, all of them, as they are appended: with `Some(n)` the list reads as
    /// `n` (`Value::read_list`) and its items are never stored.
    fn finish_list(&mut self, _items: &[Value]) -> Option<u32> {
        None
    }

    /// Asked every `CHECK_EVERY` opcodes whether to go on: an error stops the read (Ctrl-C
    /// during a large file's load).
    fn keep_going(&mut self) -> Result<(), Error> {
        Ok(())
    }
}

/// How many opcodes are read between two `Finish::keep_going` (a few milliseconds' worth).
const CHECK_EVERY: u32 = 1 << 16;

/// Python's pickler appends a list's items and sets a dict's in batches of this many (from
/// protocol 1 on, with APPENDS and SETITEMS), so a smaller batch on an empty one is all of it.
/// (An empty batch is not: protocol 0 makes an empty list, then appends item by item.)
const BATCH: usize = 1000;

/// Appends `item` to `list`, a `Kept` item to the run of them it follows.
fn push(list: &mut Vec<Value>, item: Value) {
    if let (Some(Value::Kept { first, count }), Value::Kept { first: next, count: more }) = (list.last_mut(), &item) {
        if first.checked_add(*count) == Some(*next) {
            *count += more;
            return;
        }
    }
    list.push(item);
}

/// Why a pickle could not be read.
pub type Error = String;

struct Reader<'a, F> {
    bytes: &'a [u8],
    pos: usize,
    stack: Vec<Value>,
    marks: Vec<usize>,
    memo: Memo,
    finish: &'a mut F,
    /// What the hook read along with an item (`Finish::finish`), waiting to be settled.
    read: Vec<(Value, u32)>,
    shared: Shared,
    /// `append`'s items as the hook finished them, until they are stored.
    finished: Vec<Value>,
}

/// The lists and dicts that the pickle referred to more than once. Only through one of them
/// can a container end up inside itself (`]q\x00h\x00a`: a list appended to itself), which
/// reference counting never frees; emptied when the read is done with, that cycle is broken.
#[derive(Default)]
struct Shared(Vec<Value>);

impl Shared {
    fn note(&mut self, value: &Value) {
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

/// A pickle read: its value, and what must be emptied once it is no longer needed.
pub struct Pickled {
    pub root: Value,
    _shared: Shared,
}

/// A container's memo slot, if it was memoized.
fn slot(value: &Value) -> Option<usize> {
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
struct Memo {
    dense: Vec<Value>,
    sparse: HashMap<usize, Value>,
}

impl Memo {
    fn set(&mut self, index: usize, value: Value) {
        if let Some(entry) = self.dense.get_mut(index) {
            *entry = value;
        } else if index == self.dense.len() {
            self.dense.push(value);
        } else {
            self.sparse.insert(index, value);
        }
    }

    fn get(&self, index: usize) -> Option<&Value> {
        self.dense.get(index).or_else(|| self.sparse.get(&index))
    }

    fn get_mut(&mut self, index: usize) -> Option<&mut Value> {
        self.dense.get_mut(index).or_else(|| self.sparse.get_mut(&index))
    }

    /// The index MEMOIZE gives the next entry.
    fn next(&self) -> usize {
        self.dense.len() + self.sparse.len()
    }
}

/// The containers in `read` read as their ids from now on.
fn settle(read: &mut Vec<(Value, u32)>, memo: &mut Memo) {
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
fn read_as(memo: &mut Memo, container: &Value, id: u32) {
    if let Some(entry) = slot(container).and_then(|slot| memo.get_mut(slot)) {
        if same(entry, container) {
            *entry = match container {
                Value::List(_) => Value::ReadList(id),
                _ => Value::ReadDict(id),
            };
        }
    }
}

impl<F: Finish> Reader<'_, F> {
    fn take(&mut self, n: usize) -> Result<&[u8], Error> {
        let end = self.pos.checked_add(n).filter(|&end| end <= self.bytes.len()).ok_or("the pickle ends early")?;
        let slice = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(slice)
    }

    fn byte(&mut self) -> Result<u8, Error> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32, Error> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }

    fn u64(&mut self) -> Result<u64, Error> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }

    fn line(&mut self) -> Result<&str, Error> {
        let rest = &self.bytes[self.pos..];
        let end = rest.iter().position(|&b| b == b'\n').ok_or("a text opcode has no end of line")?;
        self.pos += end + 1;
        std::str::from_utf8(&rest[..end]).map_err(|_| "a text opcode is not UTF-8".to_string())
    }

    fn text(&mut self, n: usize) -> Result<Value, Error> {
        let bytes = self.take(n)?;
        Ok(Value::Str(Rc::new(String::from_utf8_lossy(bytes).into())))
    }

    fn pop(&mut self) -> Result<Value, Error> {
        self.stack.pop().ok_or_else(|| "the pickle's stack runs dry".to_string())
    }

    fn top(&mut self) -> Result<&Value, Error> {
        self.stack.last().ok_or_else(|| "the pickle's stack runs dry".to_string())
    }

    fn pop_mark(&mut self) -> Result<Vec<Value>, Error> {
        let mark = self.mark()?;
        Ok(self.stack.split_off(mark))
    }

    fn memoize(&mut self, index: usize) -> Result<(), Error> {
        let value = self.top()?.clone();
        // An index past u32 is no file this reader can hold in memory.
        let slot = u32::try_from(index).ok().filter(|&slot| slot != NO_SLOT).ok_or("a bad memo index")?;
        match &value {
            Value::List(list) => list.slot.set(slot),
            Value::Dict(dict) => dict.slot.set(slot),
            _ => {}
        }
        self.memo.set(index, value);
        Ok(())
    }

    fn get(&mut self, index: usize) -> Result<(), Error> {
        let value = self.memo.get(index).cloned().ok_or("the pickle refers to a memo entry it never made")?;
        self.shared.note(&value);
        self.stack.push(value);
        Ok(())
    }

    /// Appends the stack's items from `from` on to `list`, each handed to the hook (drained in
    /// place: this runs for every list in the file), or all of them at once when they are the
    /// whole of a new list (`whole`: APPENDS, not APPEND, which protocol 0 writes per item).
    fn append(&mut self, target: &Value, from: usize, whole: bool) -> Result<(), Error> {
        let Value::List(list) = target else {
            self.stack.truncate(from);
            return match target {
                Value::Opaque => Ok(()),
                _ => Err("the pickle appends to something that is not a list".into()),
            };
        };
        let new = || list.kept.get().is_none() && list.items.borrow().is_empty();
        if whole && (1..BATCH).contains(&(self.stack.len() - from)) && new() {
            if let Some(id) = self.finish.finish_list(&self.stack[from..]) {
                list.kept.set(Some(id));
                read_as(&mut self.memo, target, id);
                self.stack.truncate(from);
                return Ok(());
            }
        }
        // Finished before any is stored: the hook may read this very list (an event whose
        // frames list is the list it is appended to), which it could not while it is borrowed.
        let mut finished = std::mem::take(&mut self.finished);
        for item in self.stack.drain(from..) {
            let item = match item.read_dict() {
                Some(id) => Value::Kept { first: id, count: 1 },
                None if slot(&item).is_some() => {
                    let finished = self.finish.finish(item.clone(), &mut self.read);
                    if let Value::Kept { first, .. } = finished {
                        read_as(&mut self.memo, &item, first);
                    }
                    finished
                }
                None => self.finish.finish(item, &mut self.read),
            };
            settle(&mut self.read, &mut self.memo);
            push(&mut finished, item);
        }
        let mut items = list.items.borrow_mut();
        items.reserve(finished.len());
        for item in finished.drain(..) {
            push(&mut items, item);
        }
        self.finished = finished;
        Ok(())
    }

    /// Sets the stack's key/value pairs from `from` on in `dict`, or has the hook read them when
    /// they are the whole of a new dict (`whole`: SETITEMS, not SETITEM, which protocol 0 writes
    /// per item).
    fn set_items(&mut self, target: &Value, from: usize, whole: bool) -> Result<(), Error> {
        let Value::Dict(dict) = target else {
            self.stack.truncate(from);
            return match target {
                Value::Opaque => Ok(()),
                _ => Err("the pickle sets items on something that is not a dict".into()),
            };
        };
        let pairs = (self.stack.len() - from) / 2;
        if whole && (1..BATCH).contains(&pairs) && dict.kept.get().is_none() && dict.items.borrow().is_empty() {
            if let Some(id) = self.finish.finish_dict(&self.stack[from..], &mut self.read) {
                dict.kept.set(Some(id));
                read_as(&mut self.memo, target, id);
                settle(&mut self.read, &mut self.memo);
                self.stack.truncate(from);
                return Ok(());
            }
        }
        let mut dict = dict.items.borrow_mut();
        dict.reserve(pairs);
        let mut items = self.stack.drain(from..);
        while let (Some(key), Some(value)) = (items.next(), items.next()) {
            dict.push((key, value));
        }
        Ok(())
    }

    /// Where the last mark was set.
    fn mark(&mut self) -> Result<usize, Error> {
        let mark = self.marks.pop().ok_or("a pickle opcode wants a mark that is not there")?;
        if mark > self.stack.len() {
            return Err("a mark past the stack".into());
        }
        Ok(mark)
    }

    fn run(&mut self) -> Result<Value, Error> {
        let mut ops = 0u32;
        loop {
            ops = ops.wrapping_add(1);
            if ops.is_multiple_of(CHECK_EVERY) {
                self.finish.keep_going()?;
            }
            let op = self.byte()?;
            match op {
                0x80 => {
                    let protocol = self.byte()?;
                    if protocol > 5 {
                        return Err(format!("pickle protocol {protocol} is newer than 5"));
                    }
                }
                0x95 => {
                    self.u64()?;
                }
                b'.' => return self.pop(),
                b'(' => self.marks.push(self.stack.len()),
                b'0' => {
                    self.pop()?;
                }
                b'1' => {
                    self.pop_mark()?;
                }
                b'2' => {
                    let top = self.top()?.clone();
                    self.shared.note(&top);
                    self.stack.push(top);
                }
                b'N' => self.stack.push(Value::None),
                0x88 => self.stack.push(Value::Bool(true)),
                0x89 => self.stack.push(Value::Bool(false)),
                b'J' => {
                    let n = i32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes"));
                    self.stack.push(Value::Int(n as i64));
                }
                b'K' => {
                    let n = self.byte()?;
                    self.stack.push(Value::Int(n as i64));
                }
                b'M' => {
                    let n = u16::from_le_bytes(self.take(2)?.try_into().expect("2 bytes"));
                    self.stack.push(Value::Int(n as i64));
                }
                0x8a | 0x8b => {
                    let n = if op == 0x8a { self.byte()? as usize } else { self.u32()? as usize };
                    let value = long(self.take(n)?);
                    self.stack.push(value);
                }
                b'I' | b'L' => {
                    let text = self.line()?.trim_end_matches('L').to_string();
                    self.stack.push(match text.as_str() {
                        "01" => Value::Bool(true),
                        "00" => Value::Bool(false),
                        text => text.parse().map_or(Value::Opaque, Value::Int),
                    });
                }
                b'G' => {
                    let f = f64::from_be_bytes(self.take(8)?.try_into().expect("8 bytes"));
                    self.stack.push(Value::Float(f));
                }
                b'F' => {
                    let f = self.line()?.parse().map_or(Value::Opaque, Value::Float);
                    self.stack.push(f);
                }
                0x8c | b'U' => {
                    let n = self.byte()? as usize;
                    let text = self.text(n)?;
                    self.stack.push(text);
                }
                b'X' | b'T' => {
                    let n = self.u32()? as usize;
                    let text = self.text(n)?;
                    self.stack.push(text);
                }
                0x8d => {
                    let n = self.u64()? as usize;
                    let text = self.text(n)?;
                    self.stack.push(text);
                }
                b'V' => {
                    let text = Value::Str(Rc::new(self.line()?.into()));
                    self.stack.push(text);
                }
                b'C' | b'B' | 0x8e | 0x96 => {
                    let n = match op {
                        b'C' => self.byte()? as usize,
                        b'B' => self.u32()? as usize,
                        _ => self.u64()? as usize,
                    };
                    self.take(n)?;
                    self.stack.push(Value::Bytes);
                }
                b']' => self.stack.push(Value::List(List::default())),
                b'}' => self.stack.push(Value::Dict(Dict::default())),
                b')' => self.stack.push(Value::Tuple(Rc::default())),
                0x8f => self.stack.push(Value::List(List::default())),
                b'l' => {
                    let from = self.mark()?;
                    let list = Value::List(List::default());
                    self.append(&list, from, true)?;
                    self.stack.push(list);
                }
                b'd' => {
                    let from = self.mark()?;
                    let dict = Value::Dict(Dict::default());
                    self.set_items(&dict, from, true)?;
                    self.stack.push(dict);
                }
                b't' | 0x91 => {
                    let items = self.pop_mark()?;
                    self.stack.push(Value::Tuple(Rc::new(items)));
                }
                0x85..=0x87 => {
                    let n = (op - 0x84) as usize;
                    if self.stack.len() < n {
                        return Err("the pickle's stack runs dry".into());
                    }
                    let items = self.stack.split_off(self.stack.len() - n);
                    self.stack.push(Value::Tuple(Rc::new(items)));
                }
                b'a' | b's' => {
                    // The list (or dict) sits under its one item (or key and value).
                    let n = if op == b'a' { 1 } else { 2 };
                    let from =
                        self.stack.len().checked_sub(n).filter(|&f| f > 0).ok_or("the pickle's stack runs dry")?;
                    let target = self.stack[from - 1].clone();
                    if op == b'a' {
                        self.append(&target, from, false)?;
                    } else {
                        self.set_items(&target, from, false)?;
                    }
                }
                b'e' | 0x90 | b'u' => {
                    let from = self.mark()?;
                    let target =
                        from.checked_sub(1).map(|i| self.stack[i].clone()).ok_or("the pickle's stack runs dry")?;
                    if op == b'u' {
                        self.set_items(&target, from, true)?;
                    } else {
                        self.append(&target, from, op == b'e')?;
                    }
                }
                b'p' => {
                    let index = self.line()?.parse().map_err(|_| "a bad memo index".to_string())?;
                    self.memoize(index)?;
                }
                b'q' => {
                    let index = self.byte()? as usize;
                    self.memoize(index)?;
                }
                b'r' => {
                    let index = self.u32()? as usize;
                    self.memoize(index)?;
                }
                0x94 => {
                    let index = self.memo.next();
                    self.memoize(index)?;
                }
                b'g' => {
                    let index = self.line()?.parse().map_err(|_| "a bad memo index".to_string())?;
                    self.get(index)?;
                }
                b'h' => {
                    let index = self.byte()? as usize;
                    self.get(index)?;
                }
                b'j' => {
                    let index = self.u32()? as usize;
                    self.get(index)?;
                }
                // Classes and calls: named, never looked up or run.
                b'c' => {
                    self.line()?;
                    self.line()?;
                    self.stack.push(Value::Opaque);
                }
                0x93 | b'R' | 0x81 | b'b' => {
                    self.pop()?;
                    self.pop()?;
                    self.stack.push(Value::Opaque);
                }
                0x92 => {
                    for _ in 0..3 {
                        self.pop()?;
                    }
                    self.stack.push(Value::Opaque);
                }
                b'i' => {
                    self.line()?;
                    self.line()?;
                    self.pop_mark()?;
                    self.stack.push(Value::Opaque);
                }
                b'o' => {
                    self.pop_mark()?;
                    self.stack.push(Value::Opaque);
                }
                0x82..=0x84 => {
                    self.take([1, 2, 4][(op - 0x82) as usize])?;
                    self.stack.push(Value::Opaque);
                }
                b'P' => {
                    self.line()?;
                    self.stack.push(Value::Opaque);
                }
                b'Q' => {
                    self.pop()?;
                    self.stack.push(Value::Opaque);
                }
                0x97 => self.stack.push(Value::Opaque),
                0x98 => {}
                other => return Err(format!("unknown pickle opcode 0x{other:02x} at byte {}", self.pos - 1)),
            }
        }
    }
}

/// A little-endian two's-complement integer; beyond 64 bits it is not a number we use.
fn long(bytes: &[u8]) -> Value {
    if bytes.len() > 8 {
        return Value::Opaque;
    }
    let negative = bytes.last().is_some_and(|&b| b & 0x80 != 0);
    let mut buffer = [if negative { 0xff } else { 0 }; 8];
    buffer[..bytes.len()].copy_from_slice(bytes);
    Value::Int(i64::from_le_bytes(buffer))
}

/// Reads one pickled value from `bytes`, handing each list item to `finish` as it is appended.
/// (Its containers are emptied when the result is dropped, so keep it while reading them.)
pub fn read<F: Finish>(bytes: &[u8], finish: &mut F) -> Result<Pickled, Error> {
    let mut reader = Reader {
        bytes,
        pos: 0,
        stack: Vec::new(),
        marks: Vec::new(),
        memo: Memo::default(),
        finish,
        read: Vec::new(),
        shared: Shared::default(),
        finished: Vec::new(),
    };
    let root = reader.run()?;
    Ok(Pickled { root, _shared: std::mem::take(&mut reader.shared) })
}
