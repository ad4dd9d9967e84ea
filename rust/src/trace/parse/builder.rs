//! The `Finish` hook that builds a snapshot as the pickle is read: each event dict an `Event` as
//! soon as it is made or appended, each frames list a stack, so the trace is never held as dicts.

use std::collections::HashMap;
use std::rc::Rc;

use super::budget::Budget;
use super::fields::size;
use super::stacks::{StackId, Stacks};
use super::{Action, Event};
use crate::error::{Error, Result};
use crate::trace::pickle::{self, Finish, Value};

/// How many items visited (or 16 bytes made) between two asks for Ctrl-C: some milliseconds.
const CHECK_WORK: usize = 1 << 16;

/// Turns each event dict into an `Event` as soon as the reader appends it to its trace, and
/// interns frames: a shared frame dict is read once (its id noted on it).
pub(super) struct Builder<'a> {
    pub(super) stacks: Stacks,
    pub(super) events: Vec<Event>,
    scratch: Vec<u32>,
    /// Each string object of the file (memoized once, referred to by many frames and events)
    /// and its id in `stacks`, by the object's address: a string shared a thousand times is
    /// hashed and copied once, not a thousand times. The objects are kept so that no address
    /// is reused by another string during the read.
    string_ids: HashMap<*const Box<str>, (Rc<Box<str>>, u32)>,
    pub(super) budget: Budget,
    keep_going: &'a mut dyn FnMut() -> Result<()>,
    /// Why the read stopped, when `keep_going` said so.
    pub(super) stopped: Option<Error>,
    /// The first impossible size met: its field, value and where it is.
    pub(super) impossible: Option<String>,
}

impl<'a> Builder<'a> {
    pub(super) fn new(keep_going: &'a mut dyn FnMut() -> Result<()>, file_bytes: usize) -> Builder<'a> {
        Builder {
            budget: Budget::of(file_bytes),
            stacks: Stacks::default(),
            events: Vec::new(),
            scratch: Vec::new(),
            string_ids: HashMap::new(),
            keep_going,
            stopped: None,
            impossible: None,
        }
    }

    /// The size in `value`, or 0 with the first impossible one noted (`field` of `what`).
    pub(super) fn size(&mut self, value: &Value, field: &str, what: impl FnOnce() -> String) -> u64 {
        size(value).unwrap_or_else(|shown| {
            self.impossible.get_or_insert_with(|| format!("{field} {shown} in {}", what()));
            0
        })
    }

    /// The id of a string object of the file (the empty string's for anything else), interned
    /// once per object: its bytes are charged to the budget once.
    fn string(&mut self, value: Option<&Value>) -> u32 {
        let Some(Value::Str(text)) = value else { return self.stacks.intern_string("") };
        if let Some((_, id)) = self.string_ids.get(&Rc::as_ptr(text)) {
            return *id;
        }
        // Held twice by `Stacks` (its table and its map's key), and once by `string_ids`.
        self.budget.hold(2 * text.len() + 64);
        let id = self.stacks.intern_string(text);
        self.string_ids.insert(Rc::as_ptr(text), (text.clone(), id));
        id
    }

    fn frame(&mut self, frame: &Value) -> u32 {
        if let Value::Dict(dict) = frame {
            if let Some(id) = dict.note.get() {
                return id;
            }
        }
        if !self.budget.charge(frame.item_count()) {
            return 0;
        }
        let (mut filename, mut line, mut name) = (None, 0, None);
        frame.for_each_entry(|key, value| match key {
            "filename" => filename = Some(value.clone()),
            "line" => line = value.as_int().unwrap_or(0).clamp(0, u32::MAX as i64) as u32,
            "name" => name = Some(value.clone()),
            _ => {}
        });
        let (filename, name) = (self.string(filename.as_ref()), self.string(name.as_ref()));
        let id = self.stacks.intern_frame_ids(filename, line, name);
        if let Value::Dict(dict) = frame {
            dict.note.set(Some(id));
        }
        id
    }

    /// A frames list's stack (the list read already, as `finish_list` does, or now).
    pub(super) fn stack(&mut self, frames: Option<&Value>) -> StackId {
        if let Some(stack) = frames.and_then(Value::read_list) {
            return stack;
        }
        if !self.budget.charge(frames.map_or(0, Value::item_count)) {
            return 0;
        }
        match frames {
            Some(Value::List(list)) => self.stack_of(list.borrow().iter()),
            Some(other) => self.stack_of(other.items().iter()),
            None => self.stack_of(std::iter::empty()),
        }
    }

    fn stack_of<'v>(&mut self, frames: impl Iterator<Item = &'v Value>) -> StackId {
        if self.budget.spent() {
            return 0;
        }
        let mut ids = std::mem::take(&mut self.scratch);
        ids.clear();
        ids.extend(frames.map(|frame| self.frame(frame)));
        let known = self.stacks.count();
        let stack = self.stacks.intern_stack(&ids);
        if self.stacks.count() > known {
            // Its frames in `Stacks`, and again as its map's key.
            self.budget.hold(ids.len() * 8 + 64);
        }
        self.scratch = ids;
        stack
    }

    /// A trace's events, whether read as they were made or now.
    pub(super) fn trace(&mut self, trace: &Value) -> Vec<Event> {
        let mut events = Vec::new();
        if !self.budget.charge(trace.item_count()) {
            return events;
        }
        for item in trace.items() {
            let items = match &item {
                Value::Kept { count, .. } => *count as usize,
                other => 1 + other.item_count(),
            };
            if !self.budget.charge(items) {
                return events;
            }
            if !self.budget.hold(items * std::mem::size_of::<Event>()) {
                return events;
            }
            if let Value::Kept { first, count } = item {
                events.extend_from_slice(&self.events[first as usize..][..count as usize]);
            } else if let Some(index) = item.read_dict() {
                events.push(self.events[index as usize]);
            } else if let Value::Dict(dict) = &item {
                let event = self.event(dict.borrow().iter().map(|(key, value)| (key, value)), &mut Vec::new());
                events.push(event);
            }
        }
        events
    }

    /// `trace` is every event kept, in order (one run of them).
    pub(super) fn holds_every_event(&self, trace: &Value) -> bool {
        let Value::List(list) = trace else { return false };
        let items = list.borrow();
        let count = self.events.len() as u32;
        match items.as_slice() {
            [] => count == 0,
            [Value::Kept { first: 0, count: all }] => *all == count,
            _ => false,
        }
    }

    /// Reads an event into `events`.
    fn keep<'v>(&mut self, entries: impl Iterator<Item = (&'v Value, &'v Value)>, read: &mut Vec<(Value, u32)>) -> u32 {
        let event = self.event(entries, read);
        self.budget.hold(std::mem::size_of::<Event>());
        self.events.push(event);
        (self.events.len() - 1) as u32
    }

    /// One pass over the event's entries (events are most of a snapshot); its frames list, if
    /// not read yet (an empty one, or one of 1000 frames or more), goes in `read` as its stack:
    /// complete by now, it need not be kept as a list (torch makes a new empty one per event).
    fn event<'v>(
        &mut self,
        entries: impl Iterator<Item = (&'v Value, &'v Value)>,
        read: &mut Vec<(Value, u32)>,
    ) -> Event {
        let mut event = Event {
            action: Action::Other,
            addr: 0,
            size: 0,
            stream: 0,
            time_us: 0,
            stack: 0,
            device_free: 0,
            annotation: None,
        };
        let mut frames = None;
        let mut annotation = None;
        let mut impossible = None;
        let number = |value: &Value| value.as_int().unwrap_or(0);
        let mut sized = |value: &Value, field: &'static str| {
            size(value).unwrap_or_else(|shown| {
                impossible.get_or_insert((field, shown));
                0
            })
        };
        let entries = entries.filter_map(|(key, value)| Some((key.as_str()?, value)));
        entries.for_each(|(key, value)| match key {
            "action" => event.action = Action::named(value.as_str().unwrap_or("")),
            "addr" => event.addr = number(value) as u64,
            "size" => event.size = sized(value, "size"),
            "stream" => event.stream = number(value),
            "time_us" => event.time_us = number(value),
            "device_free" => event.device_free = sized(value, "device_free"),
            "frames" => frames = Some(value),
            "user_metadata" => annotation = value.as_str().filter(|text| !text.is_empty()).map(|_| value),
            _ => {}
        });
        if let Some((field, shown)) = impossible {
            let at = self.events.len();
            self.impossible.get_or_insert_with(|| {
                format!("{field} {shown} in event {at} of the file ({:?} at address {:#x})", event.action, event.addr)
            });
        }
        event.stack = self.stack(frames);
        if let Some(list @ Value::List(_)) = frames.filter(|frames| frames.read_list().is_none()) {
            read.push((list.clone(), event.stack));
        }
        event.annotation = annotation.map(|text| self.string(Some(text)));
        event
    }
}

impl Finish for Builder<'_> {
    /// An event dict appended to a list and not read yet (see `finish_dict`) becomes an `Event`.
    fn finish(&mut self, item: Value, read: &mut Vec<(Value, u32)>) -> Value {
        let Value::Dict(dict) = &item else { return item };
        let starts_with_action = dict.borrow().first().is_some_and(|(key, _)| key.as_str() == Some("action"));
        if !starts_with_action || !self.budget.charge(dict.borrow().len()) {
            return item;
        }
        let first = self.keep(dict.borrow().iter().map(|(key, value)| (key, value)), read);
        Value::Kept { first, count: 1 }
    }

    /// An event is read as its dict is made. Torch writes `action` first; a dict that does not
    /// start with it (a frame, a block) is stored as it is, and an event written otherwise is
    /// still read, when appended or at the end.
    fn finish_dict(&mut self, items: &[Value], read: &mut Vec<(Value, u32)>) -> Option<u32> {
        if items.first().and_then(Value::as_str) != Some("action") || !self.budget.charge(items.len() / 2) {
            return None;
        }
        Some(self.keep(items.chunks_exact(2).map(|pair| (&pair[0], &pair[1])), read))
    }

    fn keep_going(&mut self) -> std::result::Result<(), pickle::Error> {
        self.budget.since_check = 0;
        (self.keep_going)().map_err(|stopped| {
            let why = stopped.to_string();
            self.stopped = Some(stopped);
            why
        })
    }

    fn due(&self) -> bool {
        self.budget.since_check >= CHECK_WORK
    }

    fn hold(&mut self, bytes: usize) -> std::result::Result<(), pickle::Error> {
        match self.budget.hold(bytes) {
            true => Ok(()),
            false => Err("it makes more than its size allows".into()),
        }
    }

    /// A frames list (every item a frame dict: one read already, or one with a `filename`) is
    /// read as its stack as it is made, never stored.
    fn finish_list(&mut self, items: &[Value]) -> Option<u32> {
        for item in items {
            let Value::Dict(dict) = item else { return None };
            if dict.note.get().is_none() {
                let entries = dict.borrow();
                if !self.budget.charge(entries.len())
                    || !entries.iter().any(|(key, _)| key.as_str() == Some("filename"))
                {
                    return None;
                }
            }
        }
        Some(self.stack_of(items.iter()))
    }
}
