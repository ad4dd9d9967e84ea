//! An experiment's code may still be running where another piece of code would finish it: its
//! `with` block in another asyncio task or thread, the thread that opened it, or a copy of the
//! experiment object rebuilt from its pickle. The rules here keep each scope to its own code:
//! only the object registered at the opening finishes it (and opens no second scope while it
//! is open); a scope whose `with` block still runs is left open by an outer scope's finish; a
//! finish on another thread waits for the main thread's next safe point, and an experiment
//! opened on another thread keeps what the main thread's cells bound while it was open.

use std::collections::BTreeSet;

use super::unreachable::Unreachable;
use super::{Dropped, Finish, Registry, Scope, ScopeId};
use crate::teardown::{Binding, NameState};

/// Which scopes opened inside one are finished with it, and which are left open.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Inner {
    /// Finished first, innermost first.
    pub finish: Vec<ScopeId>,
    /// Their `with` block still runs (in another task or thread): left open, to finish at
    /// their own exit; the outer keeps the names bound while they ran.
    pub running: Vec<ScopeId>,
}

/// What an outer scope's finish keeps for an inner one whose `with` block still runs: every
/// name its code created or rebound since it opened (`names`, judged against its opening). A
/// name that existed before and was rebound while it ran holds the running code's object as
/// much as a new one does, and so does a name bound to the inner experiment itself; the inner
/// scope's own finish judges them all by the usual rule.
pub fn bound_while_running(names: Vec<NameState>) -> BTreeSet<String> {
    names.into_iter().filter(|state| state.binding != Binding::Unchanged).map(|state| state.name).collect()
}

impl Scope {
    /// Whether one of its `with` blocks is still running.
    pub fn running(&self) -> bool {
        self.entered > 0
    }
}

impl Registry {
    /// Who opened scope `id`, and where: `identity` is the experiment object's (CPython's `id`),
    /// None where no object owns it (a tool's measurement); `on_main_thread`, whether it
    /// opened there. One opened on another thread has a sighting from its opening on: what
    /// the main thread's cells bind meanwhile is theirs (see `kept_when_unreachable`).
    pub fn opened_by(&mut self, id: ScopeId, identity: Option<u64>, on_main_thread: bool) {
        if let Some(scope) = self.scope_mut(id) {
            scope.owner_identity = identity;
            if !on_main_thread {
                scope.sighting = Some(super::Sighting::by_cells_only());
            }
        }
    }

    /// The open scope (its teardown not begun) whose experiment object is `identity`: that
    /// object can't open another one while it is open.
    pub fn open_owned_by(&self, identity: u64) -> Option<&Scope> {
        self.open.iter().find(|s| !s.closing && s.owner_identity == Some(identity))
    }

    /// Whether the object `identity` is the one registered at scope `id`'s opening: a copy
    /// rebuilt from its state (same id, another object) must never finish it.
    pub fn owned_by(&self, id: ScopeId, identity: u64) -> bool {
        self.scope(id).is_some_and(|s| s.owner_identity == Some(identity))
    }

    /// A `with` block over scope `id` begins (`true`) or ends.
    pub fn entered(&mut self, id: ScopeId, begins: bool) {
        if let Some(scope) = self.scope_mut(id) {
            scope.entered = if begins { scope.entered + 1 } else { scope.entered.saturating_sub(1) };
        }
    }

    /// The open scopes whose `with` block still runs: never replaced by their name.
    pub fn running(&self) -> BTreeSet<ScopeId> {
        self.open.iter().filter(|s| s.running()).map(|s| s.id).collect()
    }

    /// Scopes opened after `id` and still open, innermost first: those whose `with` block is
    /// still running are left open, the others finish before it does. Only the user's scopes
    /// finish their inner ones, and only the user's: a tool's scope opened inside stays open
    /// for the tool to finish, and a tool's scope finishes only itself.
    pub fn inner_of(&self, id: ScopeId) -> Inner {
        let mut inner = Inner::default();
        let Some(at) = self.open.iter().position(|s| s.id == id) else { return inner };
        if self.open[at].owner != super::Owner::User {
            return inner;
        }
        for scope in self.open[at + 1..].iter().rev().filter(|s| !s.closing && s.owner == super::Owner::User) {
            if scope.running() {
                inner.running.push(scope.id);
            } else {
                inner.finish.push(scope.id);
            }
        }
        inner
    }

    /// Scope `id` was finished on another thread: its teardown waits for the main thread's
    /// next safe point, as one dropped there does, and its report says so. Returns when.
    pub fn finished_off_main_thread(&mut self, id: ScopeId, in_shell: bool) -> Finish {
        let how = Dropped { by_collector: false, on_main_thread: false, in_shell };
        let finish = how.finish();
        if let Some(scope) = self.scope_mut(id).filter(|s| !s.closing && s.unreachable.is_none()) {
            scope.unreachable = Some(Unreachable::finished_off_main_thread(how, finish));
        }
        finish
    }
}
