//! Teardown: which names a scope deletes, and the order of the steps that give memory back.

use std::collections::{BTreeSet, HashSet};

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
/// created, since a misspelt name is the usual cause.
pub fn check_keep(requested: &[String], exists: impl Fn(&str) -> bool, created: &[String]) -> crate::error::Result<()> {
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
        let err = check_keep(&["modle".into()], |n| n == "model", &["model".into(), "opt".into()]).unwrap_err();
        assert!(matches!(err, crate::error::Error::InvalidArgument(_)), "{err:?}");
        let err = err.to_string();
        assert!(err.contains("\"modle\"") && err.contains("model, opt"), "{err}");
        assert!(check_keep(&["model".into()], |n| n == "model", &[]).is_ok());
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
