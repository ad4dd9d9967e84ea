//! The cell log's creep note: cells run one after the other, each ending higher than it began,
//! each growing the same holder of the user's (a list, a dict, a set), are memory kept a little
//! on every run, told before anything fails (issue 39, section 5). The cell's code names the
//! holders it grows; the binding reads each one's size at the cell's end; the decision is here.

use std::collections::VecDeque;

use crate::report::CellRecord;
use crate::units::bytes;

/// How many cells in a row must each end higher, growing the same holder.
pub const CELLS_IN_A_ROW: usize = 3;
/// The least rise of a cell's end over its start that counts as ending higher (the creep rule's
/// step, docs/oom-rescue.md): a cell that kept less is not creeping.
pub const LEAST_RISE: u64 = 1 << 20;
/// The holders the cell's code grows, read at its end: at most this many a cell are kept.
pub const MOST_HOLDERS: usize = 8;

/// One holder the cell's code grows (`outs.append(...)`, `cache[k] = ...`), read at the cell's end.
#[derive(Clone, Debug, PartialEq)]
pub struct HolderReading {
    /// The path the user writes (`outs`).
    pub name: String,
    /// Its items (elements, or a dict's values).
    pub items: u64,
    /// The bytes of the tensors among its items, each storage once.
    pub tensor_bytes: u64,
}

/// One logged cell's end, as the note reads it.
#[derive(Clone, Debug)]
struct CellEnd {
    execution_count: u64,
    /// Where memory rose most in the cell, and by how much: (`cuda:0` or `host`, bytes).
    rise: Option<(String, u64)>,
    holders: Vec<HolderReading>,
}

/// The last few logged cells' ends: bounded, one a cell. A cell that rose but grew no holder (a
/// failed one reads none), or grew one without rising, breaks the row; one that did neither is
/// passed over.
#[derive(Debug, Default)]
pub struct CellCreep {
    ends: VecDeque<CellEnd>,
}

impl CellCreep {
    /// The cell of `record` ended, its code growing `holders` (read now); returns the note the
    /// record should carry where it is the third (or later) in a row to end higher growing the
    /// same holder.
    pub fn cell_ended(&mut self, record: &CellRecord, holders: Vec<HolderReading>) -> Option<String> {
        let mut holders = holders;
        holders.truncate(MOST_HOLDERS);
        let rise = rise_of(record);
        if rise.is_none() && holders.is_empty() {
            return None; // a cell that moved nothing (a `print(len(outs))`) neither counts nor breaks the row
        }
        self.ends.push_back(CellEnd { execution_count: record.execution_count, rise, holders });
        while self.ends.len() > CELLS_IN_A_ROW + 1 {
            self.ends.pop_front();
        }
        self.note()
    }

    fn note(&self) -> Option<String> {
        let run: Vec<&CellEnd> = self.ends.iter().rev().take(CELLS_IN_A_ROW).collect();
        if run.len() < CELLS_IN_A_ROW || run.iter().any(|end| end.rise.is_none()) {
            return None;
        }
        let latest = run[0];
        let (place, _) = latest.rise.as_ref()?;
        if run.iter().any(|end| end.rise.as_ref().is_some_and(|(p, _)| p != place)) {
            return None;
        }
        // The cell before the row, where it was read, tells how big the holder was before it.
        let before = self.ends.iter().rev().nth(CELLS_IN_A_ROW);
        let holder = latest.holders.iter().find(|h| grew_in_each(&h.name, &run, before))?;
        let total: u64 = run.iter().filter_map(|end| end.rise.as_ref().map(|(_, r)| *r)).sum();
        let kept = if holder.tensor_bytes > 0 {
            format!("{} items, {} of tensors", holder.items, bytes(holder.tensor_bytes))
        } else {
            format!("{} items", holder.items)
        };
        Some(format!(
            "memory creeps: {CELLS_IN_A_ROW} cells in a row (In [{first}] to In [{last}]) each ended higher on {place} \
             (+{total} in all, about +{each} a run) and each grew `{name}` (now {kept}); each run again keeps about \
             as much: keep `.detach()` or `.item()` instead of a tensor that requires grad, wrap evaluation in \
             `torch.no_grad()`, or clear `{name}`",
            first = run[CELLS_IN_A_ROW - 1].execution_count,
            last = latest.execution_count,
            total = bytes(total),
            each = bytes(total / CELLS_IN_A_ROW as u64),
            name = holder.name,
        ))
    }
}

/// Whether the holder `name` grew at each cell of `run` (latest first): more items or more
/// tensor bytes than at the cell before (absent before the row counts as empty).
fn grew_in_each(name: &str, run: &[&CellEnd], before: Option<&CellEnd>) -> bool {
    let reading = |end: &CellEnd| end.holders.iter().find(|h| h.name == name).cloned();
    let mut earlier: Vec<Option<HolderReading>> = run.iter().skip(1).map(|end| reading(end)).collect();
    earlier.push(before.and_then(reading));
    run.iter().zip(earlier).all(|(end, previous)| {
        let Some(now) = reading(end) else { return false };
        let (items, tensor_bytes) = previous.map_or((0, 0), |p| (p.items, p.tensor_bytes));
        now.items > items || now.tensor_bytes > tensor_bytes
    })
}

/// The place memory rose most over the cell (its end over its start), where it rose by at least
/// [`LEAST_RISE`]: torch's allocated bytes on a GPU, else the process's host memory.
fn rise_of(record: &CellRecord) -> Option<(String, u64)> {
    let gpu = record
        .gpus
        .iter()
        .filter_map(|g| g.torch_allocated.map(|m| (format!("cuda:{}", g.torch_index), m.consumed)))
        .max_by_key(|(_, consumed)| *consumed);
    let (place, consumed) = match gpu {
        Some((place, consumed)) if consumed >= LEAST_RISE as i64 => (place, consumed),
        _ => ("host".to_string(), record.host.consumed),
    };
    u64::try_from(consumed).ok().filter(|rise| *rise >= LEAST_RISE).map(|rise| (place, rise))
}

#[cfg(test)]
#[path = "cell_creep_tests.rs"]
mod tests;
