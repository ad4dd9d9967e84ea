//! An estimate's books while its step runs: which storage is which entry of the [`Ledger`], and
//! what each event the dispatch mode and torch's hooks report means to it (an operator run, a
//! storage made, grown, freed or found to be a gradient). The bindings report the events; each
//! storage is known by its address while it lives.

use std::collections::HashMap;

use crate::estimate::{Category, Entry, Ledger, Phase, Rounding};
use crate::scalar_reads::Reads;

pub struct LedgerBooks {
    pub ledger: Ledger,
    /// A live storage's address → its entry.
    entries: HashMap<usize, Entry>,
    /// What the step read from its tensors: no operator of the ledger's, it makes nothing.
    pub reads: Reads,
}

impl LedgerBooks {
    pub fn new(rounding: Rounding) -> LedgerBooks {
        LedgerBooks { ledger: Ledger::new(rounding), entries: HashMap::new(), reads: Reads::default() }
    }

    /// A storage that exists before the step (`loaded`: one that will, a `meta` tensor's). The
    /// entry to watch for its freeing; None when it is entered already (a tied weight, a view).
    pub fn existing(&mut self, storage: usize, nbytes: u64, category: Category, loaded: bool) -> Option<Entry> {
        if self.entries.contains_key(&storage) {
            return None;
        }
        let entry = if loaded { self.ledger.loaded(nbytes, category) } else { self.ledger.existing(nbytes, category) };
        self.entries.insert(storage, entry);
        Some(entry)
    }

    /// An operator runs, in autograd's backward pass or not: the phase follows, except that the
    /// optimizer's step stays its own phase until its hook ends it.
    pub fn operator(&mut self, in_backward: bool) {
        self.ledger.count_op();
        match (in_backward, self.ledger.phase()) {
            (true, _) => self.ledger.enter(Phase::Backward),
            (false, Phase::Backward) => self.ledger.enter(Phase::Forward),
            _ => {}
        }
    }

    /// A storage an operator's output holds. Outputs the schema marks as aliases (views,
    /// in-place and `out=` results) made nothing, unless a known storage grew (`resize_`). The
    /// entry to watch when the storage is new.
    pub fn output(&mut self, storage: usize, nbytes: u64, alias: bool) -> Option<Entry> {
        if let Some(&entry) = self.entries.get(&storage) {
            self.ledger.grew(entry, nbytes);
            return None;
        }
        if alias || nbytes == 0 {
            return None;
        }
        let entry = self.ledger.made(nbytes);
        self.entries.insert(storage, entry);
        Some(entry)
    }

    /// A watched storage died. Its address may be a newer storage's by now: that one stays.
    pub fn freed(&mut self, storage: usize, entry: Entry) {
        self.ledger.freed(entry);
        if self.entries.get(&storage) == Some(&entry) {
            self.entries.remove(&storage);
        }
    }

    /// A storage turned out to be a gradient or optimizer state.
    pub fn mark(&mut self, storage: usize, category: Category) {
        if let Some(&entry) = self.entries.get(&storage) {
            self.ledger.mark(entry, category);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_storage_is_entered_once_and_views_make_nothing() {
        let mut books = LedgerBooks::new(Rounding::Exact);
        assert!(books.existing(1, 100, Category::Parameters, false).is_some());
        assert_eq!(books.existing(1, 100, Category::Parameters, false), None, "a tied weight");
        assert_eq!(books.output(2, 50, true), None, "a view of an unknown storage made nothing");
        assert_eq!(books.output(3, 0, false), None);
        assert!(books.output(4, 50, false).is_some());
        assert_eq!(books.output(4, 80, true), None, "a known storage that grew is not new");
        assert_eq!(books.ledger.peak().above_start, 80);
    }

    #[test]
    fn a_freed_address_taken_by_a_newer_storage_keeps_the_newer_entry() {
        let mut books = LedgerBooks::new(Rounding::Exact);
        let old = books.output(7, 10, false).unwrap();
        books.freed(7, old);
        let new = books.output(7, 20, false).unwrap();
        books.freed(7, old);
        books.mark(7, Category::Gradients);
        assert_eq!(books.ledger.peak().categories.gradients, 20, "the mark reached the newer entry {new}");
    }

    #[test]
    fn the_phase_follows_autograd_but_the_optimizer_keeps_its_own() {
        let mut books = LedgerBooks::new(Rounding::Exact);
        books.operator(true);
        assert_eq!(books.ledger.phase(), Phase::Backward);
        books.operator(false);
        assert_eq!(books.ledger.phase(), Phase::Forward);
        books.ledger.enter(Phase::Optimizer);
        books.operator(false);
        assert_eq!(books.ledger.phase(), Phase::Optimizer);
        assert_eq!(books.ledger.peak().ops, 3);
    }
}
