//! Teardown: which names a scope deletes, and the order of the steps that give memory back.
//! [`run`] is the whole sequence; the world it acts on comes in through two traits, which the
//! bindings implement over the user's Python namespace and torch, and the tests over fakes.

use std::collections::{BTreeSet, HashSet};

use serde::{Deserialize, Serialize};

use crate::snapshot::Snapshot;

/// The steps of a teardown, in the order they must run: references go first so that the
/// collector can free the objects, and the allocator can only return blocks nothing uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    DeleteNames,
    /// `Out` entries, `_`/`__`/`___`, the stored last exception, the last cell result.
    DropHiddenRefs,
    CollectGarbage,
    /// torch keeps cuBLAS workspaces (32–65 MiB after a matmul) until asked to free them.
    FreeCublasWorkspaces,
    EmptyCache,
    EndSnapshot,
}

pub const ORDER: [Step; 6] = [
    Step::DeleteNames,
    Step::DropHiddenRefs,
    Step::CollectGarbage,
    Step::FreeCublasWorkspaces,
    Step::EmptyCache,
    Step::EndSnapshot,
];

/// What gives memory back once the references are gone: the tail of a teardown, and all
/// of an OOM rescue (after the failed cell's frames are cleared).
pub const RELEASE: [Step; 3] = [Step::CollectGarbage, Step::FreeCublasWorkspaces, Step::EmptyCache];

/// Between the batch-size finder's trials: what the last size left cached goes back, but
/// cuBLAS's workspaces stay, as they do in a training loop. Re-made in the middle of a step,
/// they pin memory among the step's own blocks, and trials then fail below what a loop fits.
pub const BETWEEN_TRIALS: [Step; 2] = [Step::CollectGarbage, Step::EmptyCache];

/// How a name's binding now compares with the scope's start, judged by object identity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Binding {
    Created,
    Rebound,
    Unchanged,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NameState {
    pub name: String,
    pub binding: Binding,
    pub is_module: bool,
    /// Bound to the experiment being finished: `exp.finish()` leaves `exp` usable.
    pub is_owner: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub delete: Vec<String>,
    pub rebound: Vec<String>,
    pub kept: Vec<String>,
}

/// What teardown did to names and hidden references.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Names {
    /// Names the scope created, deleted.
    pub deleted: Vec<String>,
    /// Names that existed before the scope and were bound to new objects in it, deleted.
    pub rebound: Vec<String>,
    /// Names the scope created or rebound that were left alone (keep(), modules).
    pub kept: Vec<String>,
    /// Hidden references dropped: Out entries, `_`, the stored last exception.
    pub cleared: Vec<String>,
    /// Names the teardown meant to delete that are still bound after it tried, each with why:
    /// never listed as deleted.
    #[serde(default)]
    pub not_deleted: Vec<String>,
    /// Entries the scope created or rebound that look like IPython's own (`_1`, `_i9`,
    /// `__cache__`, a key that is not a plain name) and are still there once the hidden
    /// references are dropped: left in place, and listed so that the report explains the
    /// memory they may hold.
    #[serde(default)]
    pub left: Vec<String>,
}

/// An entry that looks like IPython's (`_1`, `__builtins__`) that IPython does not keep now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub label: String,
    /// It holds what it held at the scope's start, when IPython kept it: IPython forgot it (only
    /// a reset clears IPython's own entries), the scope did not make it.
    pub ipythons_at_start: bool,
}

/// Said where IPython's own entries were cleared under the scope.
pub const RESET_NOTE: &str = "the namespace was reset while the experiment was open (by IPython's %reset, \
    which clears IPython's own entries too): the reset deleted the names, not gpuexp, and what IPython keeps \
    through a reset is not listed as left";

/// The user's namespace as a scope sees it, judged against the identities pinned at its start.
pub trait Namespace {
    /// Every user name (IPython's own left out), with how it compares with the scope's start.
    fn names(&self) -> Result<Vec<NameState>, String>;
    /// Deletes a name and checks that it is gone; an error says why it is still bound. One
    /// already gone is no error: a `__del__` run by an earlier deletion may have removed it.
    fn delete(&mut self, name: &str) -> Result<(), String>;
    /// The entries [`Namespace::names`] leaves out because they look like IPython's that are
    /// not IPython's own now and not as they were at the scope's start, as the report should
    /// name them.
    fn left(&self) -> Result<Vec<Entry>, String>;
    /// The hidden references (Out entries, `_`, the stored exception) that appeared or changed
    /// during the scope: they can only refer to what the scope displayed or raised.
    fn changed_hidden(&self) -> Result<Vec<String>, String>;
    fn drop_hidden(&mut self, label: &str) -> Result<(), String>;
}

/// What gives memory back once nothing refers to it, and reads where memory stands.
pub trait Release {
    /// One of [`RELEASE`]'s steps.
    fn release(&mut self, step: Step) -> Result<(), String>;
    fn snapshot(&mut self) -> Snapshot;
}

/// What a teardown did, and where memory stood at its end.
pub struct Teardown {
    pub names: Names,
    pub end: Snapshot,
    /// A step that failed, in words; the steps after it still ran.
    pub notes: Vec<String>,
}

/// Runs every step of [`ORDER`]. A step that fails is noted and the rest still run: a teardown
/// that stopped halfway would leave memory held and no report. `namespace` is None where the
/// scope has none to act on (a function body in a script): it then only releases and measures.
pub fn run(mut namespace: Option<&mut dyn Namespace>, memory: &mut dyn Release, keep: &BTreeSet<String>) -> Teardown {
    let mut names = Names::default();
    let mut notes = Vec::new();
    let mut end = None;
    for step in ORDER {
        let done = match (step, namespace.as_deref_mut()) {
            (Step::DeleteNames, Some(namespace)) => delete_names(namespace, keep, &mut names),
            (Step::DropHiddenRefs, Some(namespace)) => drop_hidden(namespace, &mut names, &mut notes),
            (Step::DeleteNames | Step::DropHiddenRefs, None) => Ok(()),
            (Step::CollectGarbage | Step::FreeCublasWorkspaces | Step::EmptyCache, _) => memory.release(step),
            (Step::EndSnapshot, _) => {
                end = Some(memory.snapshot());
                Ok(())
            }
        };
        if let Err(e) = done {
            notes.push(format!("teardown step {step:?} failed: {e}"));
        }
    }
    Teardown { names, end: end.expect("EndSnapshot is a step of every teardown"), notes }
}

fn delete_names(namespace: &mut dyn Namespace, keep: &BTreeSet<String>, names: &mut Names) -> Result<(), String> {
    let plan = plan(namespace.names()?, keep);
    // A name that is still there after its deletion is listed apart: the report lists as
    // deleted only what really went, and the other names are still deleted.
    let mut gone = |wanted: Vec<String>, names: &mut Names| -> Vec<String> {
        let mut deleted = Vec::with_capacity(wanted.len());
        for name in wanted {
            match namespace.delete(&name) {
                Ok(()) => deleted.push(name),
                Err(why) => names.not_deleted.push(format!("{name} ({why})")),
            }
        }
        deleted
    };
    names.deleted = gone(plan.delete, names);
    names.rebound = gone(plan.rebound, names);
    names.kept = plan.kept;
    Ok(())
}

/// Drops the hidden references, then reads what is left: a `_` the user bound in the scope (which
/// IPython stops updating) is cleared, not also left. Entries IPython forgot (a reset) are not the scope's.
fn drop_hidden(namespace: &mut dyn Namespace, names: &mut Names, notes: &mut Vec<String>) -> Result<(), String> {
    let mut dropped = || -> Result<(), String> {
        for label in namespace.changed_hidden()? {
            namespace.drop_hidden(&label)?;
            names.cleared.push(label);
        }
        Ok(())
    };
    let dropped = dropped();
    let entries = namespace.left()?;
    let (forgotten, left): (Vec<Entry>, Vec<Entry>) = entries.into_iter().partition(|entry| entry.ipythons_at_start);
    if !forgotten.is_empty() {
        notes.push(RESET_NOTE.to_string());
    }
    names.left = left.into_iter().map(|entry| entry.label).collect();
    names.left.sort();
    dropped
}

/// Names that belong to IPython or to the module machinery, never to the user's data.
/// `hidden` is the shell's own list (`user_ns_hidden`); the rest are the names IPython
/// creates as a session goes on (`_12`, `_i12`, `_`, `__`, …) and module dunders.
pub fn is_system_name(name: &str, hidden: &HashSet<String>) -> bool {
    if hidden.contains(name) {
        return true;
    }
    if name.len() > 4 && name.starts_with("__") && name.ends_with("__") {
        return true;
    }
    let numbered = |rest: &str| !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit());
    matches!(name, "_" | "__" | "___" | "_i" | "_ii" | "_iii" | "_oh" | "_ih" | "_dh" | "In" | "Out")
        || name.strip_prefix("_i").is_some_and(numbered)
        || name.strip_prefix('_').is_some_and(numbered)
}

/// Decides what a finishing scope deletes. System names are filtered out by the caller.
pub fn plan(names: impl IntoIterator<Item = NameState>, keep: &BTreeSet<String>) -> Plan {
    let mut plan = Plan::default();
    for state in names {
        if state.binding == Binding::Unchanged || state.is_owner {
            continue;
        }
        if keep.contains(&state.name) || state.is_module {
            plan.kept.push(state.name);
        } else if state.binding == Binding::Created {
            plan.delete.push(state.name);
        } else {
            plan.rebound.push(state.name);
        }
    }
    plan.delete.sort();
    plan.rebound.sort();
    plan.kept.sort();
    plan
}

/// Checks names passed to `keep()`: each must exist now. The error lists what the scope
/// created, since a misspelt name is the usual cause; a name of IPython's own (`Out`, `_1`) is
/// said to be one, since gpuexp never deletes it.
pub fn check_keep(
    requested: &[String],
    exists: impl Fn(&str) -> bool,
    is_ipythons: impl Fn(&str) -> bool,
    created: &[String],
) -> crate::error::Result<()> {
    if let Some(name) = requested.iter().find(|n| is_ipythons(n)) {
        return Err(crate::error::Error::InvalidArgument(format!(
            "keep(): {name:?} is IPython's own (its output cache Out, or a name it makes such as _1, \
             _i1 or _), not one of your variables. gpuexp never deletes it, so there is nothing to keep."
        )));
    }
    let missing: Vec<&str> = requested.iter().map(String::as_str).filter(|n| !exists(n)).collect();
    if missing.is_empty() {
        return Ok(());
    }
    let created = if created.is_empty() { "none yet".to_string() } else { created.join(", ") };
    Err(crate::error::Error::InvalidArgument(format!(
        "keep(): no variable named {} exists. Names this experiment created so far: {created}. \
         Check the spelling, or call keep() after the cell that defines the name.",
        missing.iter().map(|n| format!("{n:?}")).collect::<Vec<_>>().join(", ")
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::testing::host;

    /// A namespace and a torch that record what teardown asked of them, in order.
    #[derive(Default)]
    struct World {
        names: Vec<NameState>,
        hidden: Vec<String>,
        calls: Vec<String>,
        failing: Option<&'static str>,
        /// Names whose deletion does not take (a key whose own `__hash__` hides it).
        stuck: Vec<&'static str>,
        left: Vec<Entry>,
        dropped: Vec<String>,
    }

    impl World {
        fn call(&mut self, call: String) -> Result<(), String> {
            let fails = self.failing.is_some_and(|f| call.starts_with(f));
            self.calls.push(call);
            if fails {
                Err("KeyboardInterrupt".into())
            } else {
                Ok(())
            }
        }
    }

    impl Namespace for World {
        fn names(&self) -> Result<Vec<NameState>, String> {
            Ok(self.names.clone())
        }
        fn delete(&mut self, name: &str) -> Result<(), String> {
            if self.stuck.contains(&name) {
                return Err("still bound after del".into());
            }
            self.names.retain(|n| n.name != name);
            self.call(format!("delete {name}"))
        }
        fn left(&self) -> Result<Vec<Entry>, String> {
            Ok(self.left.iter().filter(|entry| !self.dropped.contains(&entry.label)).cloned().collect())
        }
        fn changed_hidden(&self) -> Result<Vec<String>, String> {
            Ok(self.hidden.clone())
        }
        fn drop_hidden(&mut self, label: &str) -> Result<(), String> {
            self.call(format!("drop {label}"))?;
            self.dropped.push(label.into());
            Ok(())
        }
    }

    impl Release for World {
        fn release(&mut self, step: Step) -> Result<(), String> {
            self.call(format!("{step:?}"))
        }
        fn snapshot(&mut self) -> Snapshot {
            self.calls.push("snapshot".into());
            host(9.0, 1, 2)
        }
    }

    fn world() -> World {
        World {
            names: vec![
                state("model", Binding::Created),
                state("data", Binding::Unchanged),
                state("x", Binding::Rebound),
                state("best", Binding::Created),
            ],
            hidden: vec!["Out[3]".into(), "_".into()],
            ..World::default()
        }
    }

    #[test]
    fn a_teardown_deletes_then_drops_hidden_references_then_releases_then_measures() {
        let mut namespace = world();
        let mut memory = World::default();
        let done = run(Some(&mut namespace), &mut memory, &BTreeSet::from(["best".to_string()]));
        assert_eq!(done.names.deleted, ["model"]);
        assert_eq!(done.names.rebound, ["x"]);
        assert_eq!(done.names.kept, ["best"]);
        assert_eq!(done.names.cleared, ["Out[3]", "_"]);
        assert_eq!(namespace.calls, ["delete model", "delete x", "drop Out[3]", "drop _"]);
        assert_eq!(memory.calls, ["CollectGarbage", "FreeCublasWorkspaces", "EmptyCache", "snapshot"]);
        assert_eq!(done.end, host(9.0, 1, 2));
        assert!(done.notes.is_empty());
    }

    #[test]
    fn a_failed_step_is_noted_and_every_later_step_still_runs() {
        let mut namespace = World { failing: Some("drop Out"), ..world() };
        let mut memory = World { failing: Some("CollectGarbage"), ..World::default() };
        let done = run(Some(&mut namespace), &mut memory, &BTreeSet::new());
        assert_eq!(done.notes.len(), 2, "{:?}", done.notes);
        assert!(done.notes[0].contains("DropHiddenRefs") && done.notes[0].contains("KeyboardInterrupt"));
        assert!(done.notes[1].contains("CollectGarbage"));
        assert_eq!(done.names.deleted, ["best", "model"], "the names went before");
        assert_eq!(memory.calls.last().map(String::as_str), Some("snapshot"), "the end is still measured");
    }

    #[test]
    fn a_name_that_fails_to_go_is_listed_and_the_other_names_still_go() {
        let mut namespace = World { failing: Some("delete model"), ..world() };
        let done = run(Some(&mut namespace), &mut World::default(), &BTreeSet::new());
        assert_eq!(done.names.deleted, ["best"]);
        assert_eq!(done.names.rebound, ["x"]);
        assert_eq!(done.names.not_deleted, ["model (KeyboardInterrupt)"]);
        assert!(done.notes.is_empty(), "{:?}", done.notes);
    }

    #[test]
    fn a_name_still_bound_after_its_deletion_is_never_listed_as_deleted() {
        let mut namespace = World { stuck: vec!["model"], ..world() };
        let done = run(Some(&mut namespace), &mut World::default(), &BTreeSet::new());
        assert_eq!(done.names.deleted, ["best"]);
        assert_eq!(done.names.rebound, ["x"], "the other names are still deleted");
        assert_eq!(done.names.not_deleted, ["model (still bound after del)"]);
    }

    fn entry(label: &str, ipythons_at_start: bool) -> Entry {
        Entry { label: label.into(), ipythons_at_start }
    }
    #[test]
    fn entries_that_look_like_ipythons_are_listed_as_left() {
        let mut namespace = World { left: vec![entry("__cache__", false), entry("_1", false)], ..world() };
        let done = run(Some(&mut namespace), &mut World::default(), &BTreeSet::new());
        assert_eq!(done.names.left, ["_1", "__cache__"]);
        assert!(!namespace.calls.iter().any(|c| c.contains("_1") || c.contains("__cache__")), "never deleted");
        assert!(done.notes.is_empty(), "{:?}", done.notes);
    }

    #[test]
    fn a_hidden_reference_cleared_is_not_also_listed_as_left() {
        // The user's `_ = 3` in the scope: IPython stops updating `_`, which is both a changed
        // hidden reference and an entry unlike IPython's own until it is cleared.
        let mut namespace = World { left: vec![entry("_", false), entry("_7", false)], ..world() };
        let done = run(Some(&mut namespace), &mut World::default(), &BTreeSet::new());
        assert_eq!(done.names.cleared, ["Out[3]", "_"]);
        assert_eq!(done.names.left, ["_7"]);
    }

    #[test]
    fn entries_ipython_forgot_are_a_reset_said_in_a_note_not_left() {
        let forgotten = vec![entry("__builtins__", true), entry("__name__", true), entry("_9", false)];
        let mut namespace = World { left: forgotten, ..world() };
        let done = run(Some(&mut namespace), &mut World::default(), &BTreeSet::new());
        assert_eq!(done.names.left, ["_9"]);
        assert_eq!(done.notes, [RESET_NOTE]);
    }

    #[test]
    fn without_a_namespace_a_teardown_only_releases_and_measures() {
        let mut memory = World::default();
        let done = run(None, &mut memory, &BTreeSet::new());
        assert_eq!(done.names, Names::default());
        assert_eq!(memory.calls, ["CollectGarbage", "FreeCublasWorkspaces", "EmptyCache", "snapshot"]);
    }

    fn state(name: &str, binding: Binding) -> NameState {
        NameState { name: name.into(), binding, is_module: false, is_owner: false }
    }

    #[test]
    fn created_names_are_deleted_and_unchanged_ones_never() {
        let plan = plan(
            [state("model", Binding::Created), state("data", Binding::Unchanged), state("_tmp", Binding::Created)],
            &BTreeSet::new(),
        );
        assert_eq!(plan.delete, ["_tmp", "model"]);
        assert!(plan.rebound.is_empty() && plan.kept.is_empty());
    }

    #[test]
    fn rebound_names_are_listed_apart() {
        let plan = plan([state("x", Binding::Rebound), state("y", Binding::Created)], &BTreeSet::new());
        assert_eq!(plan.delete, ["y"]);
        assert_eq!(plan.rebound, ["x"]);
    }

    #[test]
    fn kept_names_modules_and_the_owner_survive() {
        let mut module = state("np", Binding::Created);
        module.is_module = true;
        let mut owner = state("exp", Binding::Created);
        owner.is_owner = true;
        let keep = BTreeSet::from(["best".to_string(), "x".to_string()]);
        let plan = plan([module, owner, state("best", Binding::Created), state("x", Binding::Rebound)], &keep);
        assert!(plan.delete.is_empty() && plan.rebound.is_empty());
        assert_eq!(plan.kept, ["best", "np", "x"]);
    }

    #[test]
    fn ipython_names_are_system_names() {
        let hidden = HashSet::from(["get_ipython".to_string()]);
        for name in ["_", "__", "___", "_7", "_i7", "_i", "_ii", "_iii", "Out", "In", "__builtins__", "get_ipython"] {
            assert!(is_system_name(name, &hidden), "{name}");
        }
        for name in ["_tmp", "_x1", "x", "_i7a", "__init", "i7"] {
            assert!(!is_system_name(name, &hidden), "{name}");
        }
    }

    #[test]
    fn keep_of_a_missing_name_lists_what_the_scope_created() {
        let none = |_: &str| false;
        let err = check_keep(&["modle".into()], |n| n == "model", none, &["model".into(), "opt".into()]).unwrap_err();
        assert!(matches!(err, crate::error::Error::InvalidArgument(_)), "{err:?}");
        let err = err.to_string();
        assert!(err.contains("\"modle\"") && err.contains("model, opt"), "{err}");
        assert!(check_keep(&["model".into()], |n| n == "model", none, &[]).is_ok());
    }

    #[test]
    fn keep_of_an_ipython_name_says_it_is_ipythons_not_that_it_is_missing() {
        let hidden = HashSet::new();
        let err = check_keep(&["Out".into()], |_| false, |n| is_system_name(n, &hidden), &[]).unwrap_err().to_string();
        assert!(err.contains("\"Out\" is IPython's own") && !err.contains("no variable"), "{err}");
    }

    #[test]
    fn steps_free_references_before_the_allocator() {
        let at = |step| ORDER.iter().position(|s| *s == step).unwrap();
        assert!(at(Step::DeleteNames) < at(Step::DropHiddenRefs));
        assert!(at(Step::DropHiddenRefs) < at(Step::CollectGarbage));
        assert!(at(Step::CollectGarbage) < at(Step::FreeCublasWorkspaces));
        assert!(at(Step::FreeCublasWorkspaces) < at(Step::EmptyCache));
        assert_eq!(ORDER.last(), Some(&Step::EndSnapshot));
        assert!(ORDER.windows(RELEASE.len()).any(|w| w == RELEASE), "a rescue releases as a teardown does");
    }
}
