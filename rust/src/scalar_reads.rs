//! What a step reads from its tensors while an estimate runs it on fake tensors: `.item()`,
//! `.tolist()`, `float(t)`. A fake tensor has no value, so each read gets a stand-in: a symbol
//! (torch's unbacked `SymFloat`, `SymInt`, `SymBool`) that arithmetic carries along, so a step
//! that only returns, keeps, adds up or logs what it read is estimated as if it had not read it.
//! Where the step needs the value itself (a branch on it, a size made from it), nothing can stand
//! in: the estimate is refused, naming the line that needed it and the read. Whether a step is
//! being run on fakes on this thread is kept here too, for `gpuexp.estimating()`.

use std::cell::Cell;

/// What a stand-in shows when the step prints or formats it, whatever the format asked.
pub const STAND_IN: &str = "<stand-in: gpuexp.estimate runs this step on fake tensors>";

/// What the refusals and notes tell the user to do.
const FIX: &str = "skip it while gpuexp estimates: `if not gpuexp.estimating(): ...`";

/// One read: the symbol that stands in for its value, and where in the user's code it was made.
#[derive(Clone, Debug, PartialEq)]
pub struct Read {
    pub symbol: String,
    pub at: Place,
}

/// A place in the user's code: `file:line` and that line's text (either unknown: None).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Place {
    pub line: Option<String>,
    pub source: Option<String>,
}

impl Place {
    /// `file:line` (`the step` where unknown), then the line's code where it is known.
    fn shown(&self) -> String {
        let line = self.line.clone().unwrap_or_else(|| "the step".into());
        match self.source.as_deref().map(str::trim).filter(|s| !s.is_empty()) {
            Some(source) => format!("{line} (`{source}`)"),
            None => line,
        }
    }
}

/// The reads of one estimate, and the `float(t)` calls that got NaN: `float()` must return a
/// Python float, so no symbol can stand in there.
#[derive(Debug, Default)]
pub struct Reads {
    reads: Vec<Read>,
    nans: Vec<Place>,
}

/// Reads named in a note or a refusal; the rest are counted.
const MOST_NAMED: usize = 3;

impl Reads {
    /// A read whose value is `symbol`, made at `at`.
    pub fn read(&mut self, symbol: String, at: Place) {
        self.reads.push(Read { symbol, at });
    }

    /// A `float(t)` of a fake tensor at `at`, which got NaN.
    pub fn nan(&mut self, at: Place) {
        if !self.nans.contains(&at) {
            self.nans.push(at);
        }
    }

    /// Why no estimate was made: the step needed, at `at`, the value of an expression over
    /// `symbols` (torch's guard on a data-dependent expression).
    pub fn needed(&self, symbols: &[String], at: &Place) -> String {
        let mut from: Vec<&Read> = self.reads.iter().filter(|read| symbols.contains(&read.symbol)).collect();
        from.dedup_by(|a, b| a.at == b.at);
        let read = match from.as_slice() {
            [] => String::new(),
            [only] if only.at == *at => String::new(),
            reads => {
                let named: Vec<String> = reads.iter().take(MOST_NAMED).map(|read| read.at.shown()).collect();
                let more = reads.len().saturating_sub(MOST_NAMED);
                let more = if more > 0 { format!(" and {more} more") } else { String::new() };
                format!(", read at {}{more}", named.join(", "))
            }
        };
        format!(
            "the step needs the value of a tensor at {}: a branch or a size depends on what it read \
             (`.item()`, `.tolist()`, `float()`, `bool()`){read}, and under fake tensors there is none. No estimate was \
             made; {FIX}",
            at.shown()
        )
    }

    /// Notes for the estimate: which `float(t)` calls got NaN. Reads whose symbols were only
    /// carried along need none: the estimate is what it would be without them.
    pub fn notes(&self) -> Vec<String> {
        if self.nans.is_empty() {
            return Vec::new();
        }
        let named: Vec<String> = self.nans.iter().take(MOST_NAMED).map(Place::shown).collect();
        let more = self.nans.len().saturating_sub(MOST_NAMED);
        let more = if more > 0 { format!(" and {more} more") } else { String::new() };
        vec![format!(
            "float() of a fake tensor returned NaN as a stand-in at {}{more}: a branch on that value took its NaN \
             side; if the step's memory depends on it, {FIX}",
            named.join(", ")
        )]
    }
}

thread_local! {
    /// How many estimates are running a step on fakes on this thread (one, unless a step
    /// estimates another).
    static ON_FAKES: Cell<u32> = const { Cell::new(0) };
}

/// Whether this thread is running a step on fake tensors for an estimate: `gpuexp.estimating()`.
pub fn estimating() -> bool {
    ON_FAKES.with(|depth| depth.get() > 0)
}

/// While it lives, [`estimating`] answers true on this thread.
pub struct OnFakes(());

impl OnFakes {
    pub fn enter() -> OnFakes {
        ON_FAKES.with(|depth| depth.set(depth.get() + 1));
        OnFakes(())
    }
}

impl Drop for OnFakes {
    fn drop(&mut self) {
        ON_FAKES.with(|depth| depth.set(depth.get().saturating_sub(1)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn place(line: &str, source: &str) -> Place {
        Place { line: Some(line.into()), source: Some(source.into()) }
    }

    #[test]
    fn a_branch_on_a_read_names_its_line_and_the_fix() {
        let mut reads = Reads::default();
        let at = place("train.py:12", "    if loss.item() > 10:");
        reads.read("zuf0".into(), at.clone());
        let why = reads.needed(&["zuf0".into()], &at);
        assert!(
            why.starts_with("the step needs the value of a tensor at train.py:12 (`if loss.item() > 10:`)"),
            "{why}"
        );
        assert!(!why.contains("read at"), "the read is the line that needed it: said once: {why}");
        assert!(why.ends_with("`if not gpuexp.estimating(): ...`"), "{why}");
    }

    #[test]
    fn a_read_elsewhere_is_named_beside_the_line_that_needed_it() {
        let mut reads = Reads::default();
        reads.read("zuf0".into(), place("train.py:10", "value = loss.item()"));
        reads.read("zuf1".into(), place("train.py:11", "other = loss.item()"));
        let why = reads.needed(&["zuf0".into()], &place("train.py:14", "if value > 1:"));
        assert!(why.contains("at train.py:14 (`if value > 1:`)"), "{why}");
        assert!(why.contains(", read at train.py:10 (`value = loss.item()`), and under"), "{why}");
        assert!(!why.contains("train.py:11"), "only the reads the expression uses: {why}");
        let unknown = Reads::default().needed(&["u3".into()], &Place::default());
        assert!(unknown.starts_with("the step needs the value of a tensor at the step:"), "{unknown}");
    }

    #[test]
    fn only_nans_make_a_note_each_place_once() {
        let mut reads = Reads::default();
        reads.read("zuf0".into(), place("a.py:1", "x"));
        assert!(reads.notes().is_empty(), "a carried symbol changes nothing");
        for line in ["a.py:2", "a.py:2", "a.py:3", "a.py:4", "a.py:5"] {
            reads.nan(place(line, "float(loss)"));
        }
        let notes = reads.notes();
        assert_eq!(notes.len(), 1);
        assert!(notes[0].starts_with("float() of a fake tensor returned NaN as a stand-in at a.py:2 (`float(loss)`)"));
        assert!(notes[0].contains("a.py:4 (`float(loss)`) and 1 more:"), "{}", notes[0]);
    }

    #[test]
    fn estimating_is_true_while_a_guard_lives_on_this_thread_only() {
        assert!(!estimating());
        let outer = OnFakes::enter();
        let inner = OnFakes::enter();
        drop(inner);
        assert!(estimating(), "still inside the outer estimate");
        assert!(!std::thread::spawn(estimating).join().unwrap(), "another thread is not on fakes");
        drop(outer);
        assert!(!estimating());
    }
}
