//! The pickle opcodes up to protocol 5, each run on the reader's stack: numbers, strings and
//! containers are built, classes and calls are named and never looked up or run (they push an
//! opaque value).

use std::rc::Rc;

use super::reader::Reader;
use super::value::{Dict, List, Value};
use super::{Error, Finish};

/// How many opcodes are read between two `Finish::keep_going` (a millisecond's worth)...
const CHECK_EVERY: u32 = 1 << 14;
/// ...or how many bytes of the file (a long string is one opcode).
const CHECK_BYTES: usize = 1 << 20;
/// What a value on the stack or in the memo holds, a mark, a new list or dict and a new tuple
/// (with their reference counts), before their items.
const VALUE: usize = std::mem::size_of::<Value>();
const MARK: usize = std::mem::size_of::<usize>();
const CONTAINER: usize = std::mem::size_of::<super::value::Container<(Value, Value)>>() + 16;
const TUPLE: usize = std::mem::size_of::<Vec<Value>>() + 16;

impl<F: Finish> Reader<'_, F> {
    /// Runs the opcodes up to STOP (`.`): the value on top of the stack then is the pickle's.
    pub(super) fn run(&mut self) -> Result<Value, Error> {
        let (mut ops, mut check_at, mut stack_high, mut marks_high) = (0u32, CHECK_BYTES, 0usize, 0usize);
        loop {
            ops += 1;
            if ops >= CHECK_EVERY || self.pos >= check_at || self.finish.due() {
                self.finish.keep_going()?;
                (ops, check_at) = (0, self.pos.saturating_add(CHECK_BYTES));
            }
            if self.stack.len() > stack_high {
                self.finish.hold((self.stack.len() - stack_high) * VALUE)?;
                stack_high = self.stack.len();
            }
            if self.marks.len() > marks_high {
                self.finish.hold((self.marks.len() - marks_high) * MARK)?;
                marks_high = self.marks.len();
            }
            let op = self.byte()?;
            match op {
                b']' | b'}' | 0x8f | b'l' | b'd' => self.finish.hold(CONTAINER)?,
                b')' | b't' | 0x91 => self.finish.hold(TUPLE)?,
                0x85..=0x87 => self.finish.hold(TUPLE + (op - 0x84) as usize * VALUE)?,
                _ => {}
            }
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
                    let text: Box<str> = self.line()?.into();
                    self.finish.hold(text.len())?;
                    self.stack.push(Value::Str(Rc::new(text)));
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
                    self.finish.hold(items.len() * VALUE)?;
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
