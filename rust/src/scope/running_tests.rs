//! The rules that keep a scope to its own running code (`running.rs`), on the registry and
//! through the lifecycle's runner.

use std::collections::BTreeSet;

use super::lifecycle::{self, Request, World};
use super::lifecycle_tests::{only, request, Fake};
use super::running::bound_while_running;
use super::{Finish, Identities, Inner, Owner, SafePoint};
use crate::teardown::{Binding, NameState};

fn names(list: &[&str]) -> BTreeSet<String> {
    list.iter().map(|n| n.to_string()).collect()
}

fn identities(pairs: &[(&str, u64)]) -> Identities {
    pairs.iter().map(|(n, i)| (n.to_string(), *i)).collect()
}

#[test]
fn an_outer_finish_leaves_a_scope_whose_with_block_runs_and_keeps_what_it_bound() {
    let mut world = Fake::default();
    let outer = lifecycle::open(&mut world, request("same")).unwrap().id;
    world.registry().entered(outer, true); // a's block: b's constructor of the same name nests
    let running = lifecycle::open(&mut world, request("same")).unwrap().id;
    assert!(world.registry().scope(outer).is_some());
    world.registry().entered(outer, false);
    let idle = lifecycle::open(&mut world, request("idle")).unwrap().id;
    world.registry().entered(running, true);
    assert_eq!(world.registry().inner_of(outer), Inner { finish: vec![idle], running: vec![running] });
    world.calls.clear();
    let finished = lifecycle::finish(&mut world, outer, BTreeSet::new(), false).unwrap();
    let finished: Vec<&str> = finished.reports.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(finished, ["idle", "same"]);
    assert!(world.registry().scope(running).is_some(), "its block still runs: it stays open");
    let teardowns = only(&world.calls, &["teardown"]);
    let kept = format!(r#"keep=["bound in {running}", "rebound in {running}"]"#);
    assert!(teardowns[1].ends_with(&kept), "what it created and what it rebound: {teardowns:?}");

    world.registry().entered(running, false);
    assert_eq!(world.registry().inner_of(running), Inner::default());
    lifecycle::finish(&mut world, running, BTreeSet::new(), false).unwrap();
    assert!(world.registry().report(running).is_some(), "it finishes at its own exit");
}

#[test]
fn a_running_scope_keeps_every_name_its_code_created_or_rebound_and_no_other() {
    let state = |name: &str, binding, is_owner| NameState { name: name.into(), binding, is_module: false, is_owner };
    let judged = vec![
        state("made_b", Binding::Created, false),
        state("shared", Binding::Rebound, false),
        state("exp_b", Binding::Created, true),
        state("model", Binding::Unchanged, false),
    ];
    assert_eq!(bound_while_running(judged), names(&["exp_b", "made_b", "shared"]));
    assert!(bound_while_running(Vec::new()).is_empty());
}

#[test]
fn a_scope_whose_with_block_runs_is_never_replaced_by_its_name() {
    let mut world = Fake::default();
    let id = lifecycle::open(&mut world, request("same")).unwrap().id;
    let mut registry = world.registry();
    registry.entered(id, true);
    registry.entered(id, true);
    registry.entered(id, false);
    assert_eq!(registry.running(), BTreeSet::from([id]), "one of two blocks still runs");
    let (no_handles, none_on_stack) = (BTreeSet::new(), BTreeSet::new());
    assert!(registry.replaced_by(Some("same"), &no_handles, &none_on_stack, Owner::User).is_empty());
    registry.entered(id, false);
    registry.entered(id, false);
    assert!(registry.running().is_empty(), "an extra exit never goes below zero");
    assert_eq!(registry.replaced_by(Some("same"), &no_handles, &none_on_stack, Owner::User), vec![id]);
}

#[test]
fn only_the_object_registered_at_the_opening_owns_the_scope_and_it_opens_no_second_one() {
    let mut world = Fake::default();
    let id = lifecycle::open(&mut world, Request { owner_identity: Some(7), ..request("mine") }).unwrap().id;
    let tools = lifecycle::open(&mut world, request("a tool's")).unwrap().id;
    let registry = world.registry();
    assert!(registry.owned_by(id, 7));
    assert!(!registry.owned_by(id, 8), "a copy rebuilt from its state is another object");
    assert!(!registry.owned_by(tools, 7) && !registry.owned_by(999, 7));
    assert_eq!(registry.open_owned_by(7).map(|s| s.name.as_str()), Some("mine"));
    assert!(registry.open_owned_by(8).is_none());
    drop(registry);
    lifecycle::finish(&mut world, id, BTreeSet::new(), false).unwrap();
    assert!(world.registry().open_owned_by(7).is_none(), "finished, it may open anew");
}

#[test]
fn a_finish_on_another_thread_waits_for_the_cells_end_and_says_so() {
    let mut world = Fake::default();
    let id = lifecycle::open(&mut world, request("timed")).unwrap().id;
    assert_eq!(world.registry().finished_off_main_thread(id, true), Finish::AtCellEnd);
    assert_eq!(world.registry().due(SafePoint::CellEnd), vec![id]);
    world.calls.clear();
    let finished = lifecycle::finish_unreachable(&mut world, SafePoint::CellEnd).unwrap();
    assert_eq!(finished.reports.len(), 1);
    assert!(finished.reports[0].notes.iter().any(|n| n.starts_with("finished on another thread")));

    let mut world = Fake::default();
    let in_script = lifecycle::open(&mut world, request("script")).unwrap().id;
    assert_eq!(world.registry().finished_off_main_thread(in_script, false), Finish::AtNextOpening);
}

#[test]
fn one_opened_on_another_thread_keeps_only_what_the_main_threads_cells_bound() {
    let mut world = Fake::default();
    let id = lifecycle::open(&mut world, Request { on_main_thread: false, ..request("bg") }).unwrap().id;
    let mut registry = world.registry();
    registry.cell_ended(&BTreeSet::new(), identities(&[]), &names(&["mine"]));
    registry.finished_off_main_thread(id, true);
    let now = identities(&[("mine", 1), ("made_in_bg", 2)]);
    let (kept, note) = registry.kept_when_unreachable(id, &now).expect("waits");
    assert_eq!(kept, names(&["mine"]), "what its own thread bound is its own");
    assert!(note.contains("main thread's cells bound"), "{note}");

    // Opened on the main thread, the names bound since it was last seen are the user's.
    drop(registry);
    let main = lifecycle::open(&mut world, request("main")).unwrap().id;
    let mut registry = world.registry();
    registry.cell_ended(&BTreeSet::from([main]), identities(&[("model", 3)]), &BTreeSet::new());
    registry.finished_off_main_thread(main, true);
    let now = identities(&[("model", 3), ("later", 4)]);
    assert_eq!(registry.kept_when_unreachable(main, &now).unwrap().0, names(&["later"]));
}

#[test]
fn an_opening_cut_short_finishes_at_once_deleting_no_name() {
    let mut world = Fake::default();
    let id = lifecycle::open(&mut world, request("cut")).unwrap().id;
    world.calls.clear();
    let finished = lifecycle::finish_cut_opening(&mut world, id, "KeyboardInterrupt").unwrap();
    assert!(only(&world.calls, &["teardown"])[0].contains("names=false"));
    let note = &finished.reports[0].notes;
    assert!(note.iter().any(|n| n.contains("opening was interrupted (KeyboardInterrupt)")), "{note:?}");
    assert!(world.registry().scope(id).is_none());
}
