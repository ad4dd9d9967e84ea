//! A reader for pickles of plain data (dicts, lists, tuples, strings, numbers), protocols 2 to
//! 5. It runs no code: a class or a call in the file becomes an opaque value, never an import.
//! Memoized objects are shared, not copied (torch's snapshots share each frame dict among every
//! stack that has it), and a `Finish` hook turns each finished list item into something compact
//! as soon as it is appended, so a large trace is never held as a tree of dicts.

use std::cell::RefCell;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::rc::Rc;

/// Hashes addresses and ids: a multiply spreads them. They are not chosen by anyone who could
/// aim at collisions, so SipHash's protection (and cost) is not needed.
#[derive(Default)]
pub struct QuickHasher(u64);

impl Hasher for QuickHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 = (self.0.rotate_left(8) ^ byte as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0 ^ n).wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(29);
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(n as u64);
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }
}

/// A map keyed by addresses.
pub type AddressMap<V> = HashMap<usize, V, Quick>;

/// `QuickHasher` for any map.
pub type Quick = BuildHasherDefault<QuickHasher>;

pub type List = Rc<RefCell<Vec<Value>>>;
pub type Dict = Rc<RefCell<Vec<(Value, Value)>>>;

#[derive(Clone, Debug)]
pub enum Value {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(Rc<str>),
    Bytes,
    List(List),
    Dict(Dict),
    Tuple(Rc<[Value]>),
    /// A class, a call's result, a persistent id: never evaluated.
    Opaque,
    /// An item the hook made compact (an index into what the hook keeps).
    Kept(u32),
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

    /// The items of a list or tuple.
    pub fn items(&self) -> Vec<Value> {
        match self {
            Value::List(list) => list.borrow().clone(),
            Value::Tuple(items) => items.to_vec(),
            _ => Vec::new(),
        }
    }
}

/// What the reader does with an item as it is appended to a list: keep it, or replace it by
/// something smaller (`Value::Kept`). Containers it names in `released` (by `container_key`)
/// leave the memo: the hook knows they are never referred to again (a later reference would
/// read `Opaque`).
pub trait Finish {
    fn finish(&mut self, item: Value, released: &mut Vec<usize>) -> Value;
}

/// Why a pickle could not be read.
pub type Error = String;

struct Reader<'a, F> {
    bytes: &'a [u8],
    pos: usize,
    stack: Vec<Value>,
    marks: Vec<usize>,
    memo: Vec<Value>,
    /// Where each memoized container sits in the memo, so a finished one can leave it.
    slots: AddressMap<usize>,
    finish: &'a mut F,
}

/// A container's identity while it is alive.
pub fn container_key(value: &Value) -> Option<usize> {
    match value {
        Value::List(list) => Some(Rc::as_ptr(list) as *const u8 as usize),
        Value::Dict(dict) => Some(Rc::as_ptr(dict) as *const u8 as usize),
        _ => None,
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
        Ok(Value::Str(String::from_utf8_lossy(bytes).into()))
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
        if index >= self.memo.len() {
            self.memo.resize(index + 1, Value::None);
        }
        if let Some(key) = container_key(&value) {
            self.slots.insert(key, index);
        }
        self.memo[index] = value;
        Ok(())
    }

    fn get(&mut self, index: usize) -> Result<(), Error> {
        let value = self.memo.get(index).cloned().ok_or("the pickle refers to a memo entry it never made")?;
        self.stack.push(value);
        Ok(())
    }

    /// Appends the stack's items from `from` on to `list`, each handed to the hook (drained in
    /// place: this runs for every list in the file).
    fn append(&mut self, list: &Value, from: usize) -> Result<(), Error> {
        let Value::List(list) = list else {
            self.stack.truncate(from);
            return match list {
                Value::Opaque => Ok(()),
                _ => Err("the pickle appends to something that is not a list".into()),
            };
        };
        let mut list = list.borrow_mut();
        list.reserve(self.stack.len() - from);
        let mut released = Vec::new();
        for item in self.stack.drain(from..) {
            list.push(self.finish.finish(item, &mut released));
            for key in released.drain(..) {
                if let Some(slot) = self.slots.remove(&key) {
                    self.memo[slot] = Value::Opaque;
                }
            }
        }
        Ok(())
    }

    /// Sets the stack's key/value pairs from `from` on in `dict`.
    fn set_items(&mut self, dict: &Value, from: usize) -> Result<(), Error> {
        let Value::Dict(dict) = dict else {
            self.stack.truncate(from);
            return match dict {
                Value::Opaque => Ok(()),
                _ => Err("the pickle sets items on something that is not a dict".into()),
            };
        };
        let mut dict = dict.borrow_mut();
        dict.reserve((self.stack.len() - from) / 2);
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
        loop {
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
                    let text = Value::Str(self.line()?.into());
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
                b')' => self.stack.push(Value::Tuple(Rc::from(Vec::new()))),
                0x8f => self.stack.push(Value::List(List::default())),
                b'l' => {
                    let from = self.mark()?;
                    let list = Value::List(List::default());
                    self.append(&list, from)?;
                    self.stack.push(list);
                }
                b'd' => {
                    let from = self.mark()?;
                    let dict = Value::Dict(Dict::default());
                    self.set_items(&dict, from)?;
                    self.stack.push(dict);
                }
                b't' | 0x91 => {
                    let items = self.pop_mark()?;
                    self.stack.push(Value::Tuple(items.into()));
                }
                0x85..=0x87 => {
                    let n = (op - 0x84) as usize;
                    if self.stack.len() < n {
                        return Err("the pickle's stack runs dry".into());
                    }
                    let items = self.stack.split_off(self.stack.len() - n);
                    self.stack.push(Value::Tuple(items.into()));
                }
                b'a' | b's' => {
                    // The list (or dict) sits under its one item (or key and value).
                    let n = if op == b'a' { 1 } else { 2 };
                    let from =
                        self.stack.len().checked_sub(n).filter(|&f| f > 0).ok_or("the pickle's stack runs dry")?;
                    let target = self.stack[from - 1].clone();
                    if op == b'a' {
                        self.append(&target, from)?;
                    } else {
                        self.set_items(&target, from)?;
                    }
                }
                b'e' | 0x90 | b'u' => {
                    let from = self.mark()?;
                    let target =
                        from.checked_sub(1).map(|i| self.stack[i].clone()).ok_or("the pickle's stack runs dry")?;
                    if op == b'u' {
                        self.set_items(&target, from)?;
                    } else {
                        self.append(&target, from)?;
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
                    let index = self.memo.len();
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
pub fn read<F: Finish>(bytes: &[u8], finish: &mut F) -> Result<Value, Error> {
    let mut reader = Reader {
        bytes,
        pos: 0,
        stack: Vec::new(),
        marks: Vec::new(),
        memo: Vec::new(),
        slots: AddressMap::default(),
        finish,
    };
    reader.run()
}
