//! A pickle reader for plain data (protocols 2 to 5: dicts, lists, tuples, sets, strings,
//! bytes, numbers, None, booleans) that runs no code: an opcode that would import or call
//! anything is refused.
//!
//! Torch's snapshot shares one frame dict (and one frames list) between every entry that has
//! it, and a shared container whose members are memoized is more than serde-pickle's reader
//! handles (it consumes the members at the container's first visit, then refuses the second
//! as "recursive"). Here the objects live in an arena, the memo holds their indices, and the
//! tree is expanded into serde-pickle's `Value` only at the end, shared parts copied.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde_pickle::{HashableValue, Value};

enum Node {
    Leaf(Value),
    List(Vec<usize>),
    Tuple(Vec<usize>),
    Dict(Vec<(usize, usize)>),
    Set(Vec<usize>),
    FrozenSet(Vec<usize>),
}

struct Machine<'a> {
    bytes: &'a [u8],
    at: usize,
    nodes: Vec<Node>,
    stack: Vec<usize>,
    marks: Vec<usize>,
    memo: HashMap<u32, usize>,
}

/// How deep nested containers may go: torch's snapshot needs five levels; a deeper or cyclic
/// structure is no snapshot.
const MAX_DEPTH: usize = 64;

impl<'a> Machine<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len()).ok_or("truncated pickle")?;
        let slice = &self.bytes[self.at..end];
        self.at = end;
        Ok(slice)
    }

    fn uint(&mut self, n: usize) -> Result<u64, String> {
        Ok(self.take(n)?.iter().rev().fold(0u64, |acc, &b| (acc << 8) | u64::from(b)))
    }

    fn push(&mut self, node: Node) {
        self.nodes.push(node);
        self.stack.push(self.nodes.len() - 1);
    }

    fn pop(&mut self) -> Result<usize, String> {
        self.stack.pop().ok_or_else(|| "stack underflow".to_string())
    }

    fn pop_mark(&mut self) -> Result<Vec<usize>, String> {
        let mark = self.marks.pop().ok_or("no mark")?;
        if mark > self.stack.len() {
            return Err("mark past the stack".into());
        }
        Ok(self.stack.split_off(mark))
    }

    fn top(&self) -> Result<usize, String> {
        self.stack.last().copied().ok_or_else(|| "stack underflow".to_string())
    }

    fn text(&mut self, n: usize) -> Result<(), String> {
        let raw = self.take(n)?;
        let text = String::from_utf8_lossy(raw).into_owned();
        self.push(Node::Leaf(Value::String(text)));
        Ok(())
    }

    fn long(&mut self, n: usize) -> Result<(), String> {
        let raw = self.take(n)?;
        if raw.len() > 8 {
            return Err("an integer beyond 64 bits".into());
        }
        let negative = raw.last().is_some_and(|&b| b & 0x80 != 0);
        let mut word = [if negative { 0xff } else { 0 }; 8];
        word[..raw.len()].copy_from_slice(raw);
        self.push(Node::Leaf(Value::I64(i64::from_le_bytes(word))));
        Ok(())
    }

    fn extend(&mut self, container: usize, items: Vec<usize>) -> Result<(), String> {
        match &mut self.nodes[container] {
            Node::List(list) | Node::Set(list) => list.extend(items),
            Node::Dict(pairs) => {
                if !items.len().is_multiple_of(2) {
                    return Err("a dict item without its value".into());
                }
                pairs.extend(items.chunks(2).map(|kv| (kv[0], kv[1])));
            }
            _ => return Err("items added to what is no container".into()),
        }
        Ok(())
    }

    fn run(&mut self) -> Result<usize, String> {
        loop {
            let op = self.take(1)?[0];
            match op {
                0x80 => _ = self.take(1)?, // PROTO
                0x95 => _ = self.take(8)?, // FRAME
                b'.' => return self.pop(), // STOP
                b'(' => self.marks.push(self.stack.len()),
                b'}' => self.push(Node::Dict(Vec::new())),
                b']' => self.push(Node::List(Vec::new())),
                b')' => self.push(Node::Tuple(Vec::new())),
                0x8f => self.push(Node::Set(Vec::new())),
                b't' => {
                    let items = self.pop_mark()?;
                    self.push(Node::Tuple(items));
                }
                0x85..=0x87 => {
                    let n = usize::from(op - 0x84);
                    let from = self.stack.len().checked_sub(n).ok_or("stack underflow")?;
                    let items = self.stack.split_off(from);
                    self.push(Node::Tuple(items));
                }
                0x91 => {
                    let items = self.pop_mark()?;
                    self.push(Node::FrozenSet(items));
                }
                b'l' => {
                    let items = self.pop_mark()?;
                    self.push(Node::List(items));
                }
                b'd' => {
                    let items = self.pop_mark()?;
                    self.push(Node::Dict(Vec::new()));
                    let dict = self.top()?;
                    self.extend(dict, items)?;
                }
                b'a' => {
                    let item = self.pop()?;
                    let list = self.top()?;
                    self.extend(list, vec![item])?;
                }
                b'e' | b'u' | 0x90 => {
                    let items = self.pop_mark()?;
                    let container = self.top()?;
                    self.extend(container, items)?;
                }
                b's' => {
                    let value = self.pop()?;
                    let key = self.pop()?;
                    let dict = self.top()?;
                    self.extend(dict, vec![key, value])?;
                }
                b'X' => {
                    let n = self.uint(4)? as usize;
                    self.text(n)?;
                }
                0x8c => {
                    let n = self.uint(1)? as usize;
                    self.text(n)?;
                }
                0x8d => {
                    let n = usize::try_from(self.uint(8)?).map_err(|_| "a string too long")?;
                    self.text(n)?;
                }
                b'C' | b'B' | 0x8e => {
                    let width = match op {
                        b'C' => 1,
                        b'B' => 4,
                        _ => 8,
                    };
                    let n = usize::try_from(self.uint(width)?).map_err(|_| "bytes too long")?;
                    let raw = self.take(n)?.to_vec();
                    self.push(Node::Leaf(Value::Bytes(raw)));
                }
                b'J' => {
                    let raw = self.take(4)?;
                    let value = i32::from_le_bytes([raw[0], raw[1], raw[2], raw[3]]);
                    self.push(Node::Leaf(Value::I64(i64::from(value))));
                }
                b'K' => {
                    let value = self.uint(1)? as i64;
                    self.push(Node::Leaf(Value::I64(value)));
                }
                b'M' => {
                    let value = self.uint(2)? as i64;
                    self.push(Node::Leaf(Value::I64(value)));
                }
                0x8a => {
                    let n = self.uint(1)? as usize;
                    self.long(n)?;
                }
                0x8b => {
                    let n = self.uint(4)? as usize;
                    self.long(n)?;
                }
                b'G' => {
                    let raw = self.take(8)?;
                    let value = f64::from_be_bytes(raw.try_into().map_err(|_| "truncated float")?);
                    self.push(Node::Leaf(Value::F64(value)));
                }
                b'N' => self.push(Node::Leaf(Value::None)),
                0x88 => self.push(Node::Leaf(Value::Bool(true))),
                0x89 => self.push(Node::Leaf(Value::Bool(false))),
                0x94 => {
                    let id = u32::try_from(self.memo.len()).map_err(|_| "memo too large")?;
                    let top = self.top()?;
                    self.memo.insert(id, top);
                }
                b'q' | b'r' => {
                    let id = self.uint(if op == b'q' { 1 } else { 4 })? as u32;
                    let top = self.top()?;
                    self.memo.insert(id, top);
                }
                b'h' | b'j' => {
                    let id = self.uint(if op == b'h' { 1 } else { 4 })? as u32;
                    let node = *self.memo.get(&id).ok_or_else(|| format!("memo {id} is missing"))?;
                    self.stack.push(node);
                }
                b'0' => _ = self.pop()?,
                b'1' => _ = self.pop_mark()?,
                b'2' => {
                    let top = self.top()?;
                    self.stack.push(top);
                }
                b'c' | 0x93 | b'R' | 0x81 | 0x92 | b'b' | b'i' | b'o' | b'P' | b'Q' => {
                    return Err(format!("it asks to import or call code (opcode 0x{op:02x}), which gpuexp never runs"))
                }
                _ => return Err(format!("opcode 0x{op:02x} at byte {} is not plain data", self.at - 1)),
            }
        }
    }

    fn value(&self, node: usize, depth: usize) -> Result<Value, String> {
        if depth > MAX_DEPTH {
            return Err("nested too deep (or cyclic)".into());
        }
        let all = |items: &[usize]| items.iter().map(|&i| self.value(i, depth + 1)).collect::<Result<Vec<_>, _>>();
        let hashable = |items: &[usize]| {
            items.iter().map(|&i| self.hashable(i, depth + 1)).collect::<Result<BTreeSet<_>, String>>()
        };
        Ok(match &self.nodes[node] {
            Node::Leaf(value) => value.clone(),
            Node::List(items) => Value::List(all(items)?),
            Node::Tuple(items) => Value::Tuple(all(items)?),
            Node::Set(items) => Value::Set(hashable(items)?),
            Node::FrozenSet(items) => Value::FrozenSet(hashable(items)?),
            Node::Dict(pairs) => {
                let mut map = BTreeMap::new();
                for &(key, value) in pairs {
                    map.insert(self.hashable(key, depth + 1)?, self.value(value, depth + 1)?);
                }
                Value::Dict(map)
            }
        })
    }

    fn hashable(&self, node: usize, depth: usize) -> Result<HashableValue, String> {
        self.value(node, depth)?.into_hashable().map_err(|e| e.to_string())
    }
}

/// The plain data a pickle holds, shared objects copied where they are shared.
pub fn read(bytes: &[u8]) -> Result<Value, String> {
    let mut machine =
        Machine { bytes, at: 0, nodes: Vec::new(), stack: Vec::new(), marks: Vec::new(), memo: HashMap::new() };
    let root = machine.run()?;
    machine.value(root, 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fixtures_read_as_serde_pickle_reads_them() {
        for bytes in [
            &include_bytes!("testdata/snapshot_p2.pickle")[..],
            include_bytes!("testdata/snapshot_p4.pickle"),
            include_bytes!("testdata/snapshot_p5.pickle"),
        ] {
            let theirs = serde_pickle::value_from_slice(bytes, serde_pickle::DeOptions::new()).unwrap();
            assert_eq!(read(bytes).unwrap(), theirs);
        }
    }

    #[test]
    fn code_is_refused_and_garbage_is_an_error_not_a_panic() {
        // pickle.dumps(os.system) at protocol 4: STACK_GLOBAL.
        let global = b"\x80\x04\x95\x15\x00\x00\x00\x00\x00\x00\x00\x8c\x05posix\x94\x8c\x06system\x94\x93\x94.";
        assert!(read(global).unwrap_err().contains("never runs"));
        for garbage in [&b""[..], b"\x80", b"not a pickle", b"\x80\x04]\x94(e"] {
            assert!(read(garbage).is_err(), "{garbage:?}");
        }
    }
}
