//! Experiments that nothing refers to any more. Dropped by the user's own code on the main
//! thread (`del exp`, the last list that held one going), an experiment finishes at once, where
//! the user dropped it. Found by Python's cycle collector (held only by a reference cycle: an
//! object that holds it and refers to itself, a class body), or dropped on another thread, it
//! goes at whatever point that code had reached, in the middle of any statement: deleting names
//! there would take them from under the statement. Its teardown waits for a point where that is
//! safe: the end of the cell in a notebook; elsewhere the next experiment's opening or the
//! interpreter's exit.
//!
//! Nobody knows when such an experiment became unreachable, only when the collector found it.
//! So the names bound after one of the user's names was last seen to lead to it (at a cell's
//! end) are the user's, kept and listed; where it was never seen so (a script), every name is.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use super::{Owner, Registry, ScopeId};

/// How the last reference to an open experiment went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dropped {
    /// Python's cycle collector found it: its finalizer ran inside a collection.
    pub by_collector: bool,
    pub on_main_thread: bool,
    /// In an IPython shell, whose cell events gpuexp listens to.
    pub in_shell: bool,
}

/// When an experiment that nothing refers to finishes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// Where the user's code dropped it.
    Now,
    /// At the end of the running cell (of the next one, between cells).
    AtCellEnd,
    /// At the next experiment's opening, or at the interpreter's exit.
    AtNextOpening,
}

/// The points where a waiting teardown may run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SafePoint {
    CellEnd,
    Opening,
    Exit,
}

impl SafePoint {
    /// `"cell_end"`, `"opening"` or `"exit"`.
    pub fn parse(text: &str) -> crate::error::Result<SafePoint> {
        match text {
            "cell_end" => Ok(SafePoint::CellEnd),
            "opening" => Ok(SafePoint::Opening),
            "exit" => Ok(SafePoint::Exit),
            other => {
                Err(crate::error::Error::InvalidArgument(format!("at={other:?}: one of 'cell_end', 'opening', 'exit'")))
            }
        }
    }
}

impl Dropped {
    pub fn finish(&self) -> Finish {
        match self {
            Dropped { by_collector: false, on_main_thread: true, .. } => Finish::Now,
            Dropped { in_shell: true, .. } => Finish::AtCellEnd,
            Dropped { in_shell: false, .. } => Finish::AtNextOpening,
        }
    }

    /// What the report says of how the experiment ended.
    fn note(&self, finish: Finish) -> String {
        let how = if self.by_collector {
            "nothing referred to it but a reference cycle, which Python's garbage collector found"
        } else {
            "its last reference went on another thread"
        };
        let when = match finish {
            Finish::AtCellEnd => "it finished at the end of the cell, not in the middle of a statement",
            Finish::Now | Finish::AtNextOpening => "it finished at the next experiment's opening or at exit",
        };
        format!(
            "{how}; {when}. Names bound since one of yours last led to it are yours, kept and listed as kept; \
             finish it with exp.finish() or a with block to have them deleted"
        )
    }
}

/// The user's names at a moment, each with the identity of the object it held (CPython's `id`).
/// No reference is kept: nothing stays alive for it.
pub type Identities = HashMap<String, u64>;

/// The last time one of the user's names was seen to lead to a scope, and what the cells run
/// since then bound by their own code (a name rebound to an object at a freed one's address has
/// the same identity).
#[derive(Clone, Debug)]
pub struct Sighting {
    names: Arc<Identities>,
    bound_since: BTreeSet<String>,
    /// Whether a name whose object changed since counts as the user's. Not for a scope opened
    /// on another thread, until one of the user's names leads to it: everything it saw bound
    /// there but what the main thread's cells bound was its own thread's doing.
    by_identity: bool,
}

impl Sighting {
    /// From the opening of a scope on another thread: only the cells' own bindings are the user's.
    pub(super) fn by_cells_only() -> Sighting {
        Sighting { names: Arc::default(), bound_since: BTreeSet::new(), by_identity: false }
    }
}

/// A scope found unreachable, waiting for its teardown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Unreachable {
    dropped: Dropped,
    finish: Finish,
    /// Finished by its own code on another thread (`finish()`, a `with` exit), not dropped.
    finished: bool,
}

impl Unreachable {
    pub(super) fn finished_off_main_thread(dropped: Dropped, finish: Finish) -> Unreachable {
        Unreachable { dropped, finish, finished: true }
    }

    /// What the report says of how the experiment ended.
    fn note(&self) -> String {
        if !self.finished {
            return self.dropped.note(self.finish);
        }
        let when = match self.finish {
            Finish::AtCellEnd => "its teardown ran at the end of the cell running then",
            Finish::Now | Finish::AtNextOpening => "its teardown ran at the next experiment's opening or at exit",
        };
        format!(
            "finished on another thread, where deleting names would take them from under the code still running; \
             {when}. Names the main thread's cells bound while it was open are yours, kept and listed as kept"
        )
    }
}

impl Registry {
    /// The last reference to scope `id` went as `how`: returns when it finishes, and remembers a
    /// teardown that must wait.
    pub fn dropped(&mut self, id: ScopeId, how: Dropped) -> Finish {
        let finish = how.finish();
        if finish != Finish::Now {
            if let Some(scope) = self.scope_mut(id).filter(|s| !s.closing && s.unreachable.is_none()) {
                scope.unreachable = Some(Unreachable { dropped: how, finish, finished: false });
            }
        }
        finish
    }

    /// Whether a scope found unreachable waits for its teardown.
    pub fn unreachable_waiting(&self) -> bool {
        self.open.iter().any(|s| s.unreachable.is_some() && !s.closing)
    }

    /// The waiting scopes whose teardown may run `at` this point, innermost first. One of the
    /// user's that an experiment of the user's opened inside it and still alive waits for that
    /// one: inner scopes finish first, and a live one is no unreachable one's to finish. A
    /// tool's scope finishes only itself, so nothing inside it makes it wait.
    pub fn due(&self, at: SafePoint) -> Vec<ScopeId> {
        let mut due = Vec::new();
        let mut live_inside = false;
        for scope in self.open.iter().rev().filter(|s| !s.closing) {
            let ready = scope.unreachable.is_some_and(|u| match at {
                SafePoint::CellEnd => u.finish == Finish::AtCellEnd,
                SafePoint::Opening => u.finish == Finish::AtNextOpening,
                SafePoint::Exit => true,
            });
            if ready && !(live_inside && scope.owner == Owner::User) {
                due.push(scope.id);
            } else if scope.owner == Owner::User {
                live_inside = true;
            }
        }
        due
    }

    /// A cell has ended: one of the user's names leads to each scope in `sighted` (`names`: the
    /// user's names now); `bound`: the names the cell's own code binds, which every other scope
    /// that was seen before adds to what was bound since.
    pub fn cell_ended(&mut self, sighted: &BTreeSet<ScopeId>, names: Identities, bound: &BTreeSet<String>) {
        let names = Arc::new(names);
        for scope in self.open.iter_mut().filter(|s| !s.closing) {
            if sighted.contains(&scope.id) && scope.unreachable.is_none() {
                scope.sighting =
                    Some(Sighting { names: names.clone(), bound_since: BTreeSet::new(), by_identity: true });
            } else if let Some(sighting) = scope.sighting.as_mut() {
                sighting.bound_since.extend(bound.iter().cloned());
            }
        }
    }

    /// For the teardown of a scope found unreachable: the names of `now` (the user's names at
    /// the teardown) that are the user's, bound since the scope was last seen, and what the
    /// report says of it. None for a scope that was not found unreachable.
    pub fn kept_when_unreachable(&self, id: ScopeId, now: &Identities) -> Option<(BTreeSet<String>, String)> {
        let scope = self.scope(id)?;
        let unreachable = scope.unreachable?;
        let bound_since = |name: &String, identity: &u64| match &scope.sighting {
            None => true,
            Some(seen) => {
                (seen.by_identity && seen.names.get(name) != Some(identity)) || seen.bound_since.contains(name)
            }
        };
        let kept = now.iter().filter(|(name, identity)| bound_since(name, identity)).map(|(n, _)| n.clone()).collect();
        Some((kept, unreachable.note()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scope::{Kind, Opening};
    use crate::snapshot::testing::host;
    use crate::snapshot::GpuSelection;

    const COLLECTOR: Dropped = Dropped { by_collector: true, on_main_thread: true, in_shell: true };

    fn open(registry: &mut Registry, name: &str, owner: Owner) -> ScopeId {
        registry.open(Opening {
            name: name.into(),
            kind: Kind::Cpu,
            selection: GpuSelection::None,
            start: host(0.0, 0, 0),
            cell_log: false,
            limit: None,
            handles: BTreeSet::new(),
            params: None,
            owner,
        })
    }

    fn identities(pairs: &[(&str, u64)]) -> Identities {
        pairs.iter().map(|(n, i)| (n.to_string(), *i)).collect()
    }

    fn names(list: &[&str]) -> BTreeSet<String> {
        list.iter().map(|n| n.to_string()).collect()
    }

    #[test]
    fn the_users_own_drop_on_the_main_thread_finishes_now_and_nothing_else_does() {
        let user = Dropped { by_collector: false, on_main_thread: true, in_shell: true };
        assert_eq!(user.finish(), Finish::Now);
        assert_eq!(Dropped { in_shell: false, ..user }.finish(), Finish::Now, "`del exp` in a script too");
        assert_eq!(COLLECTOR.finish(), Finish::AtCellEnd);
        assert_eq!(Dropped { on_main_thread: false, ..user }.finish(), Finish::AtCellEnd);
        assert_eq!(Dropped { in_shell: false, ..COLLECTOR }.finish(), Finish::AtNextOpening);
        assert_eq!(Dropped { in_shell: false, on_main_thread: false, ..user }.finish(), Finish::AtNextOpening);
    }

    #[test]
    fn a_collected_scope_waits_for_the_cell_end_and_a_scripts_for_the_next_opening_or_exit() {
        let mut registry = Registry::default();
        let in_cell = open(&mut registry, "a", Owner::User);
        assert_eq!(registry.due(SafePoint::CellEnd), Vec::<ScopeId>::new(), "nothing found yet");
        assert!(!registry.unreachable_waiting());
        assert_eq!(registry.dropped(in_cell, COLLECTOR), Finish::AtCellEnd);
        assert!(registry.unreachable_waiting());
        assert_eq!(registry.due(SafePoint::Opening), Vec::<ScopeId>::new(), "never at an opening in a cell");
        assert_eq!(registry.due(SafePoint::CellEnd), vec![in_cell]);
        assert_eq!(registry.due(SafePoint::Exit), vec![in_cell]);

        let mut registry = Registry::default();
        let in_script = open(&mut registry, "b", Owner::User);
        registry.dropped(in_script, Dropped { in_shell: false, ..COLLECTOR });
        assert_eq!(registry.due(SafePoint::CellEnd), Vec::<ScopeId>::new());
        assert_eq!(registry.due(SafePoint::Opening), vec![in_script]);
        assert_eq!(registry.due(SafePoint::Exit), vec![in_script]);
    }

    #[test]
    fn a_collected_scope_waits_for_a_live_inner_scope_of_the_users_and_goes_with_collected_ones() {
        let mut registry = Registry::default();
        let outer = open(&mut registry, "outer", Owner::User);
        let inner = open(&mut registry, "inner", Owner::User);
        let tools = open(&mut registry, "a run", Owner::Tool);
        registry.dropped(outer, COLLECTOR);
        assert_eq!(registry.due(SafePoint::CellEnd), Vec::<ScopeId>::new(), "the live inner one finishes first");
        registry.dropped(inner, COLLECTOR);
        assert_eq!(registry.due(SafePoint::CellEnd), vec![inner, outer], "innermost first; a tool's run is no block");
        assert!(registry.scope(tools).is_some());
    }

    #[test]
    fn a_collected_tools_scope_never_waits_for_the_users_scopes_inside_it() {
        let mut registry = Registry::default();
        let tools = open(&mut registry, "a run", Owner::Tool);
        let users = open(&mut registry, "opened in a step", Owner::User);
        registry.dropped(tools, COLLECTOR);
        assert_eq!(registry.due(SafePoint::CellEnd), vec![tools]);
        assert!(registry.scope(users).is_some_and(|s| s.unreachable.is_none()));
    }

    #[test]
    fn names_bound_since_the_scope_was_last_seen_are_kept_and_those_before_are_not() {
        let mut registry = Registry::default();
        let id = open(&mut registry, "runner", Owner::User);
        let seen = identities(&[("r", 1), ("model_weights", 2), ("results", 3), ("lr", 4)]);
        registry.cell_ended(&BTreeSet::from([id]), seen, &names(&["model_weights"]));
        // `del r`, then a cell binds `tmp` and rebinds `results` to a new dict at the old one's
        // address, which only the cell's own code tells; `lr` keeps its object.
        registry.cell_ended(&BTreeSet::new(), identities(&[]), &names(&["results", "tmp"]));
        assert_eq!(registry.kept_when_unreachable(id, &identities(&[])), None, "not found unreachable");
        registry.dropped(id, COLLECTOR);
        let now = identities(&[("model_weights", 2), ("results", 3), ("lr", 4), ("tmp", 5), ("later", 6)]);
        let (kept, note) = registry.kept_when_unreachable(id, &now).expect("found unreachable");
        assert_eq!(kept, names(&["later", "results", "tmp"]));
        assert!(note.contains("garbage collector") && note.contains("end of the cell"), "{note}");

        // Seen anew at a later cell's end, what was bound before that is the experiment's again.
        registry.cell_ended(&BTreeSet::from([id]), now.clone(), &BTreeSet::new());
        let (kept, _) = registry.kept_when_unreachable(id, &now).expect("found unreachable");
        assert_eq!(kept, names(&["later", "results", "tmp"]), "a scope found unreachable is never seen again");
    }

    #[test]
    fn a_scope_never_seen_at_a_cells_end_keeps_every_name() {
        let mut registry = Registry::default();
        let id = open(&mut registry, "in a script", Owner::User);
        registry.dropped(id, Dropped { in_shell: false, ..COLLECTOR });
        let now = identities(&[("arr", 1), ("results", 2)]);
        let (kept, note) = registry.kept_when_unreachable(id, &now).expect("found unreachable");
        assert_eq!(kept, names(&["arr", "results"]));
        assert!(note.contains("next experiment's opening or at exit"), "{note}");
    }

    #[test]
    fn a_safe_point_is_read_from_its_name_and_another_name_says_which_there_are() {
        assert_eq!(SafePoint::parse("cell_end").unwrap(), SafePoint::CellEnd);
        assert_eq!(SafePoint::parse("opening").unwrap(), SafePoint::Opening);
        assert_eq!(SafePoint::parse("exit").unwrap(), SafePoint::Exit);
        let error = SafePoint::parse("later").unwrap_err().to_string();
        assert!(error.contains("'cell_end', 'opening', 'exit'"), "{error}");
    }
}
