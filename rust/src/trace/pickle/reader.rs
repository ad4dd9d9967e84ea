//! The reader's state as it runs a pickle's opcodes: the bytes and where it is in them, its
//! stack and marks, the memo, and how lists and dicts are filled, each item or the whole of a
//! new one handed to the `Finish` hook (the opcodes themselves are in `opcodes.rs`).

use std::rc::Rc;

use super::memo::{read_as, settle, slot, Memo, Shared};
use super::value::{Value, NO_SLOT};
use super::{Error, Finish};

/// Python's pickler appends a list's items and sets a dict's in batches of this many (from
/// protocol 1 on, with APPENDS and SETITEMS), so a smaller batch on an empty one is all of it.
/// (An empty batch is not: protocol 0 makes an empty list, then appends item by item.)
const BATCH: usize = 1000;

/// The errors of a pickle cut short.
pub(super) const ENDS_EARLY: &str = "the pickle ends early";
pub(super) const NO_END_OF_LINE: &str = "a text opcode has no end of line";

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

/// A pickle being read: what the opcodes (`opcodes.rs`) work on.
pub(super) struct Reader<'a, F> {
    bytes: &'a [u8],
    pub(super) pos: usize,
    pub(super) stack: Vec<Value>,
    pub(super) marks: Vec<usize>,
    pub(super) memo: Memo,
    pub(super) finish: &'a mut F,
    /// What the hook read along with an item (`Finish::finish`), waiting to be settled.
    read: Vec<(Value, u32)>,
    pub(super) shared: Shared,
    /// `append`'s items as the hook finished them, until they are stored.
    finished: Vec<Value>,
}

impl<'a, F: Finish> Reader<'a, F> {
    pub(super) fn new(bytes: &'a [u8], finish: &'a mut F) -> Reader<'a, F> {
        Reader {
            bytes,
            pos: 0,
            stack: Vec::new(),
            marks: Vec::new(),
            memo: Memo::default(),
            finish,
            read: Vec::new(),
            shared: Shared::default(),
            finished: Vec::new(),
        }
    }

    /// The containers referred to more than once, for the read's result to empty when dropped.
    pub(super) fn take_shared(&mut self) -> Shared {
        std::mem::take(&mut self.shared)
    }

    pub(super) fn take(&mut self, n: usize) -> Result<&[u8], Error> {
        let end = self.pos.checked_add(n).filter(|&end| end <= self.bytes.len()).ok_or(ENDS_EARLY)?;
        let slice = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(slice)
    }

    pub(super) fn byte(&mut self) -> Result<u8, Error> {
        Ok(self.take(1)?[0])
    }

    pub(super) fn u32(&mut self) -> Result<u32, Error> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }

    pub(super) fn u64(&mut self) -> Result<u64, Error> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }

    pub(super) fn line(&mut self) -> Result<&str, Error> {
        let rest = &self.bytes[self.pos..];
        let end = rest.iter().position(|&b| b == b'\n').ok_or(NO_END_OF_LINE)?;
        self.pos += end + 1;
        std::str::from_utf8(&rest[..end]).map_err(|_| "a text opcode is not UTF-8".to_string())
    }

    pub(super) fn text(&mut self, n: usize) -> Result<Value, Error> {
        let bytes = self.take(n)?;
        let text: Box<str> = String::from_utf8_lossy(bytes).into();
        self.finish.hold(text.len())?;
        Ok(Value::Str(Rc::new(text)))
    }

    pub(super) fn pop(&mut self) -> Result<Value, Error> {
        self.stack.pop().ok_or_else(|| "the pickle's stack runs dry".to_string())
    }

    pub(super) fn top(&mut self) -> Result<&Value, Error> {
        self.stack.last().ok_or_else(|| "the pickle's stack runs dry".to_string())
    }

    pub(super) fn pop_mark(&mut self) -> Result<Vec<Value>, Error> {
        let mark = self.mark()?;
        Ok(self.stack.split_off(mark))
    }

    pub(super) fn memoize(&mut self, index: usize) -> Result<(), Error> {
        let value = self.top()?.clone();
        // An index past u32 is no file this reader can hold in memory.
        let slot = u32::try_from(index).ok().filter(|&slot| slot != NO_SLOT).ok_or("a bad memo index")?;
        match &value {
            Value::List(list) => list.slot.set(slot),
            Value::Dict(dict) => dict.slot.set(slot),
            _ => {}
        }
        if self.memo.get(index).is_none() {
            self.finish.hold(std::mem::size_of::<Value>())?;
        }
        self.memo.set(index, value);
        Ok(())
    }

    pub(super) fn get(&mut self, index: usize) -> Result<(), Error> {
        let value = self.memo.get(index).cloned().ok_or("the pickle refers to a memo entry it never made")?;
        self.shared.note(&value);
        self.stack.push(value);
        Ok(())
    }

    /// Appends the stack's items from `from` on to `list`, each handed to the hook (drained in
    /// place: this runs for every list in the file), or all of them at once when they are the
    /// whole of a new list (`whole`: APPENDS, not APPEND, which protocol 0 writes per item).
    pub(super) fn append(&mut self, target: &Value, from: usize, whole: bool) -> Result<(), Error> {
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
        let held = finished.len() * std::mem::size_of::<Value>();
        if let Err(refused) = self.finish.hold(held) {
            self.finished = finished;
            return Err(refused);
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
    pub(super) fn set_items(&mut self, target: &Value, from: usize, whole: bool) -> Result<(), Error> {
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
        self.finish.hold(pairs * 2 * std::mem::size_of::<Value>())?;
        let mut dict = dict.items.borrow_mut();
        dict.reserve(pairs);
        let mut items = self.stack.drain(from..);
        while let (Some(key), Some(value)) = (items.next(), items.next()) {
            dict.push((key, value));
        }
        Ok(())
    }

    /// Where the last mark was set.
    pub(super) fn mark(&mut self) -> Result<usize, Error> {
        let mark = self.marks.pop().ok_or("a pickle opcode wants a mark that is not there")?;
        if mark > self.stack.len() {
            return Err("a mark past the stack".into());
        }
        Ok(mark)
    }
}
