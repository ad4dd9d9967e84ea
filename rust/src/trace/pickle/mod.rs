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
//!
//! - `value`: what a pickle is read into (`Value`, its `Container`s) and how deep nesting is freed;
//! - `memo`: what a pickle refers back to (the memo, containers referred to twice, ones read);
//! - `reader`: the reader's bytes, stack and marks, and how lists and dicts are filled;
//! - `opcodes`: each opcode run on the reader.

mod memo;
mod opcodes;
mod reader;
mod value;

pub use value::{Container, Dict, List, Value};

use memo::Shared;
use reader::Reader;

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

    /// Asked every `CHECK_EVERY` opcodes, every `CHECK_BYTES` of the file and whenever `due`
    /// says so, whether to go on: an error stops the read (Ctrl-C during a large file's load).
    fn keep_going(&mut self) -> Result<(), Error> {
        Ok(())
    }

    /// Whether the hook's own work since the last `keep_going` (frames and events read) calls
    /// for another one now: the check goes by work done, not by opcodes, whatever they cost.
    fn due(&self) -> bool {
        false
    }

    /// The reader made `bytes` more that it holds (stack and memo entries, containers, their
    /// items, strings): an error stops the read, so what a file makes is bounded by its size.
    fn hold(&mut self, _bytes: usize) -> Result<(), Error> {
        Ok(())
    }
}

/// Why a pickle could not be read.
pub type Error = String;

/// A pickle read: its value, and what must be emptied once it is no longer needed.
pub struct Pickled {
    pub root: Value,
    _shared: Shared,
}

/// What a pickle's first bytes tell of the whole: an error here is the error reading all of it
/// (the reader goes byte by byte and nothing later changes what came before), so a large file
/// of something else is refused from its start. Running out of bytes is no error here.
pub fn check_start(start: &[u8]) -> Result<(), Error> {
    struct Plain;
    impl Finish for Plain {
        fn finish(&mut self, item: Value, _read: &mut Vec<(Value, u32)>) -> Value {
            item
        }
    }
    match read(start, &mut Plain) {
        Err(why) if why != reader::ENDS_EARLY && why != reader::NO_END_OF_LINE => Err(why),
        _ => Ok(()),
    }
}

/// Reads one pickled value from `bytes`, handing each list item to `finish` as it is appended.
/// (Its containers are emptied when the result is dropped, so keep it while reading them.)
pub fn read<F: Finish>(bytes: &[u8], finish: &mut F) -> Result<Pickled, Error> {
    let mut reader = Reader::new(bytes, finish);
    let root = reader.run()?;
    Ok(Pickled { root, _shared: reader.take_shared() })
}
