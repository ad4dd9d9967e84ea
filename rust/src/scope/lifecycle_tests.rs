//! The lifecycle's runner against a world that records what it was asked, in order.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use super::lifecycle::{self, FinishStep, OpenStep, Request, World, FINISH, OPEN};
use super::{Dropped, Identities, Owner, Registry, SafePoint, ScopeId};
use crate::monitor::Sample;
use crate::report::Report;
use crate::snapshot::testing::host;
use crate::snapshot::{GpuSelection, Snapshot};
use crate::teardown::{Binding, NameState, Names, Teardown};
use crate::trace::TraceKinds;

#[derive(Debug, PartialEq)]
pub(super) struct Failed(pub(super) String);

impl From<crate::error::Error> for Failed {
    fn from(error: crate::error::Error) -> Failed {
        Failed(error.to_string())
    }
}

impl std::fmt::Display for Failed {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The handles a fake experiment holds: what its opening gave it, and a flag its drop sets.
#[derive(Default)]
pub(super) struct Handles {
    parts: Vec<&'static str>,
    dropped: Option<Arc<AtomicBool>>,
}

impl Drop for Handles {
    fn drop(&mut self) {
        if let Some(dropped) = &self.dropped {
            dropped.store(true, Ordering::SeqCst);
        }
    }
}

#[derive(Default)]
pub(super) struct Fake {
    registry: Mutex<Registry>,
    pub(super) calls: Vec<String>,
    /// The call that fails.
    failing: Option<&'static str>,
    held: bool,
    /// Whether Ctrl-C comes while interrupts are held.
    interrupt: bool,
    own_gpu: Option<u32>,
    /// Set on the handles each opening attaches.
    dropped: Option<Arc<AtomicBool>>,
    publish_note: Option<&'static str>,
}

impl Fake {
    fn call(&mut self, call: &str) -> Result<(), Failed> {
        self.calls.push(call.to_string());
        if self.failing == Some(call) {
            return Err(Failed(format!("{call} failed")));
        }
        Ok(())
    }

    fn record(&mut self, call: &str) {
        self.calls.push(call.to_string());
    }
}

impl World for Fake {
    type Held = Handles;
    type Error = Failed;

    fn registry(&self) -> MutexGuard<'_, Registry> {
        self.registry.lock().unwrap()
    }
    fn unknown(id: ScopeId) -> Failed {
        Failed(format!("no experiment scope with id {id}"))
    }
    fn new_held(&mut self) -> Handles {
        Handles::default()
    }
    fn hold_interrupts(&mut self) {
        self.held = true;
        self.record("hold_interrupts");
    }
    fn release_interrupts(&mut self) -> bool {
        self.record("release_interrupts");
        std::mem::take(&mut self.held) && self.interrupt
    }
    fn prepare_publishing(&mut self) -> Result<(), Failed> {
        self.call("prepare_publishing")
    }
    fn own_gpu(&mut self) -> Option<(u32, String)> {
        self.record("own_gpu");
        self.own_gpu.map(|index| (index, "LOCAL_RANK".into()))
    }
    fn check_devices(&mut self, wanted: &[u32]) -> Result<(), Failed> {
        self.call(&format!("check_devices {wanted:?}"))
    }
    fn start_trace(&mut self, held: &mut Handles) -> Vec<String> {
        self.record("start_trace");
        held.parts.push("trace");
        vec!["trace note".into()]
    }
    fn take_inventory(&mut self, held: &mut Handles) -> Result<(), Failed> {
        held.parts.push("inventory");
        self.call("take_inventory")
    }
    fn pin(&mut self, held: &mut Handles) -> Result<(), Failed> {
        held.parts.push("pins");
        held.dropped = self.dropped.clone();
        self.call("pin")
    }
    fn apply_limit(&mut self, held: &mut Handles, _: &GpuSelection, limit: u64) -> Result<(), Failed> {
        held.parts.push("limit");
        self.call(&format!("apply_limit {limit}"))
    }
    fn start_monitor(&mut self, held: &mut Handles, interval: Duration, _: bool) -> Result<(), Failed> {
        held.parts.push("monitor");
        self.call(&format!("start_monitor {}ms", interval.as_millis()))
    }
    fn start_host_trace(&mut self, held: &mut Handles) -> Vec<String> {
        self.record("start_host_trace");
        held.parts.push("host trace");
        vec!["host trace note".into()]
    }
    fn start_snapshot(&mut self, _: &GpuSelection) -> Snapshot {
        self.record("start_snapshot");
        host(1.0, 100, 100)
    }
    fn reset_counters(&mut self, _: &Snapshot) {
        let registered = self.registry().gpuexp_active();
        self.record(if registered { "reset_counters (registered)" } else { "reset_counters" });
    }
    fn arm_recorder(&mut self) {
        self.record("arm_recorder");
    }
    fn collect_garbage(&mut self) -> Result<(), Failed> {
        self.call("collect_garbage")
    }
    fn identities(&mut self, id: ScopeId) -> Result<Identities, Failed> {
        self.call(&format!("identities {id}"))?;
        Ok(Identities::from([("after".to_string(), 7)]))
    }
    fn names_since_opening(&mut self, id: ScopeId) -> Result<Vec<NameState>, Failed> {
        self.call(&format!("names_since_opening {id}"))?;
        let state = |name: String, binding| NameState { name, binding, is_module: false, is_owner: false };
        Ok(vec![
            state(format!("bound in {id}"), Binding::Created),
            state(format!("rebound in {id}"), Binding::Rebound),
            state("older".into(), Binding::Unchanged),
        ])
    }
    fn snapshot(&mut self, _: &GpuSelection) -> Snapshot {
        self.record("snapshot");
        host(2.0, 300, 300)
    }
    fn finish_host_trace(&mut self, _: &mut Handles) {
        self.record("finish_host_trace");
    }
    fn teardown(&mut self, held: &mut Handles, _: &GpuSelection, keep: &BTreeSet<String>, names: bool) -> Teardown {
        let keep: Vec<&str> = keep.iter().map(String::as_str).collect();
        self.record(&format!("teardown {} names={names} keep={keep:?}", held.parts.join("+")));
        Teardown { names: Names::default(), end: host(3.0, 100, 300), notes: Vec::new() }
    }
    fn inventory_notes(&self, _: &Handles) -> Vec<String> {
        vec!["2 objects skipped".into()]
    }
    fn restore_limit(&mut self, _: &mut Handles) -> Result<(), Failed> {
        self.call("restore_limit")
    }
    fn stop_monitor(&mut self, _: &mut Handles) -> Vec<Sample> {
        self.record("stop_monitor");
        Vec::new()
    }
    fn hunt_leaks(&mut self, _: &mut Handles, _: &mut Report) -> Result<(), Failed> {
        self.call("hunt_leaks")
    }
    fn drop_pins(&mut self, _: &mut Handles) {
        self.record("drop_pins");
    }
    fn complete_trace(&mut self, _: &mut Handles, _: &mut Report) {
        self.record("complete_trace");
    }
    fn complete_host_trace(&mut self, _: &mut Handles, _: &mut Report) {
        self.record("complete_host_trace");
    }
    fn complete_ranks(&mut self, _: &mut Report) {
        self.record("complete_ranks");
    }
    fn update_sampler(&mut self) {
        self.record("update_sampler");
    }
    fn settle_recording(&mut self) {
        self.record("settle_recording");
    }
    fn publish(&mut self, id: ScopeId, _: &Report) -> Vec<String> {
        self.record(&format!("publish {id}"));
        self.publish_note.map(String::from).into_iter().collect()
    }
}

pub(super) fn request(name: &str) -> Request {
    Request {
        name: Some(name.into()),
        gpu: false,
        devices: None,
        in_namespace: true,
        cell_log: true,
        limit: None,
        monitor_s: None,
        handles: BTreeSet::new(),
        in_use: BTreeSet::new(),
        on_stack: BTreeSet::new(),
        params: None,
        trace: None,
        owner: Owner::User,
        owner_identity: None,
        on_main_thread: true,
    }
}

/// Every option on: each step of an opening has work to do.
fn everything(name: &str) -> Request {
    Request { gpu: true, limit: Some(1 << 30), monitor_s: Some(0.02), trace: Some(TraceKinds::All), ..request(name) }
}

/// The world's call that each step of an opening makes, where it makes one of its own.
fn open_call(step: OpenStep) -> Option<&'static str> {
    Some(match step {
        OpenStep::PreparePublishing => "prepare_publishing",
        OpenStep::HoldInterrupts => "hold_interrupts",
        OpenStep::SelectDevices => "own_gpu",
        OpenStep::StartTrace => "start_trace",
        OpenStep::TakeInventory => "take_inventory",
        OpenStep::Pin => "pin",
        OpenStep::ApplyLimit => "apply_limit 1073741824",
        OpenStep::StartMonitor => "start_monitor 20ms",
        OpenStep::StartHostTrace => "start_host_trace",
        OpenStep::StartSnapshot => "start_snapshot",
        // Register is the registry's: the counters are reset once the scope is in it.
        OpenStep::ResetCounters => "reset_counters (registered)",
        OpenStep::ArmRecorder => "arm_recorder",
        OpenStep::ReleaseInterrupts => "release_interrupts",
        OpenStep::FinishUnreachable | OpenStep::FinishReplaced | OpenStep::Register | OpenStep::Publish => return None,
    })
}

fn finish_call(step: FinishStep) -> Option<&'static str> {
    Some(match step {
        FinishStep::BeforeSnapshot => "snapshot",
        FinishStep::FinishHostTrace => "finish_host_trace",
        FinishStep::Teardown => "teardown",
        FinishStep::RestoreLimit => "restore_limit",
        FinishStep::StopMonitor => "stop_monitor",
        FinishStep::HuntLeaks => "hunt_leaks",
        FinishStep::DropPins => "drop_pins",
        FinishStep::CompleteTrace => "complete_trace",
        FinishStep::CompleteHostTrace => "complete_host_trace",
        FinishStep::CompleteRanks => "complete_ranks",
        FinishStep::UpdateSampler => "update_sampler",
        FinishStep::SettleRecording => "settle_recording",
        FinishStep::FinishInner
        | FinishStep::AddKeep
        | FinishStep::KeepWhatCameAfter
        | FinishStep::BeginFinish
        | FinishStep::BuildReport
        | FinishStep::Record => return None,
    })
}

/// The calls that begin with one of `wanted`, in the order they came.
pub(super) fn only<'a>(calls: &'a [String], wanted: &[&str]) -> Vec<&'a str> {
    calls.iter().map(String::as_str).filter(|c| wanted.iter().any(|w| c.starts_with(w))).collect()
}

#[test]
fn an_opening_runs_the_steps_of_open_in_order() {
    let mut world = Fake::default();
    let opened = lifecycle::open(&mut world, everything("a")).unwrap();
    let expected: Vec<&str> = OPEN.into_iter().filter_map(open_call).collect();
    assert_eq!(world.calls, expected);
    assert_eq!(opened.start.notes, ["trace note", "host trace note"], "the trace's notes go in the start");
    assert_eq!(opened.title, "a · started");
    assert!(!opened.interrupted);
    let registry = world.registry();
    let held: &Handles = registry.attached(opened.id).unwrap();
    assert_eq!(held.parts, ["trace", "inventory", "pins", "limit", "monitor", "host trace"]);
}

#[test]
fn a_finishing_runs_the_steps_of_finish_in_order() {
    let mut world = Fake::default();
    let id = lifecycle::open(&mut world, everything("a")).unwrap().id;
    world.calls.clear();
    let finished = lifecycle::finish(&mut world, id, BTreeSet::from(["kept".to_string()]), false).unwrap();
    let mut expected: Vec<String> = vec!["hold_interrupts".into()];
    expected.extend(FINISH.into_iter().filter_map(finish_call).map(String::from));
    expected[3] = r#"teardown trace+inventory+pins+limit+monitor+host trace names=true keep=["kept"]"#.into();
    expected.extend(["release_interrupts".to_string(), format!("publish {id}")]);
    assert_eq!(world.calls, expected, "the handles the opening attached come back to the teardown");
    assert_eq!(finished.reports.len(), 1);
    assert!(finished.reports[0].notes.contains(&"2 objects skipped".to_string()));
    assert!(world.registry().report(id).is_some() && world.registry().scope(id).is_none());
}

#[test]
fn what_the_cell_binds_above_a_replacing_constructor_is_kept_by_the_experiment_it_replaces() {
    let mut world = Fake::default();
    let old = lifecycle::open(&mut world, request("a")).unwrap().id;
    world.calls.clear();
    let opened = lifecycle::open(&mut world, Request { in_use: BTreeSet::from(["x".into()]), ..request("a") }).unwrap();
    assert_eq!(opened.replaced.len(), 1);
    assert!(world.registry().report(old).is_some());
    let teardown = world.calls.iter().position(|c| c.starts_with("teardown")).unwrap();
    let start = world.calls.iter().position(|c| c == "start_snapshot").unwrap();
    assert!(teardown < start, "the replaced experiment's memory is back before the new one starts");
    assert!(world.calls[teardown].ends_with(r#"keep=["x"]"#), "{}", world.calls[teardown]);
    assert_eq!(world.calls.last().map(String::as_str), Some(format!("publish {old}").as_str()));
}

#[test]
fn an_opening_first_finishes_the_experiments_found_unreachable_in_a_script() {
    let mut world = Fake::default();
    let lost = lifecycle::open(&mut world, request("lost")).unwrap().id;
    let how = Dropped { by_collector: true, on_main_thread: true, in_shell: false };
    world.registry().dropped(lost, how);
    world.calls.clear();
    let opened = lifecycle::open(&mut world, request("next")).unwrap();
    assert_eq!(opened.replaced.len(), 1);
    let calls = only(&world.calls, &["identities", "teardown", "start_snapshot"]);
    assert_eq!(calls[0], format!("identities {lost}"));
    assert!(calls[1].ends_with(r#"keep=["after"]"#), "what came after it is kept: {}", calls[1]);
    assert_eq!(calls[2], "start_snapshot");
}

#[test]
fn an_interrupt_held_while_opening_is_handed_to_the_caller_once_the_experiment_is_open() {
    let mut world = Fake { interrupt: true, ..Fake::default() };
    let opened = lifecycle::open(&mut world, request("a")).unwrap();
    assert!(opened.interrupted);
    assert!(world.registry().scope(opened.id).is_some());
}

#[test]
fn a_failed_step_skips_the_rest_but_interrupts_are_given_back_and_nothing_is_registered() {
    let mut world = Fake { failing: Some("pin"), ..Fake::default() };
    let error = lifecycle::open(&mut world, everything("a")).err().unwrap();
    assert_eq!(error, Failed("pin failed".into()));
    let after_pin = &world.calls[world.calls.iter().position(|c| c == "pin").unwrap() + 1..];
    assert_eq!(after_pin, ["release_interrupts"]);
    assert!(!world.held);
    assert!(!world.registry().gpuexp_active());
}

#[test]
fn a_rank_covers_its_own_gpu_and_says_so_unless_devices_names_others() {
    let mut world = Fake { own_gpu: Some(3), ..Fake::default() };
    let opened = lifecycle::open(&mut world, request_gpu("a", None)).unwrap();
    assert!(world.calls.contains(&"check_devices [3]".to_string()));
    assert_eq!(world.registry().scope(opened.id).unwrap().selection, GpuSelection::Only(vec![3]));
    assert_eq!(opened.start.notes, ["a rank: covers cuda:3 only, LOCAL_RANK; devices= names others"]);

    let mut world = Fake { own_gpu: Some(3), ..Fake::default() };
    let opened = lifecycle::open(&mut world, request_gpu("b", Some(vec![0, 1]))).unwrap();
    assert!(!world.calls.contains(&"own_gpu".to_string()));
    assert!(world.calls.contains(&"check_devices [0, 1]".to_string()));
    assert!(opened.start.notes.is_empty());
}

fn request_gpu(name: &str, devices: Option<Vec<u32>>) -> Request {
    Request { gpu: true, devices, ..request(name) }
}

#[test]
fn outside_a_namespace_nothing_is_pinned_or_inventoried_and_a_cpu_experiment_selects_no_gpu() {
    let mut world = Fake::default();
    let opened = lifecycle::open(&mut world, Request { in_namespace: false, ..request("a") }).unwrap();
    assert!(!world.calls.iter().any(|c| c == "pin" || c == "take_inventory" || c == "own_gpu"));
    assert_eq!(world.registry().scope(opened.id).unwrap().selection, GpuSelection::None);
}

#[test]
fn a_cpu_experiment_cannot_trace_cuda_and_nothing_runs() {
    let mut world = Fake::default();
    let error = lifecycle::open(&mut world, Request { trace: Some(TraceKinds::Cuda), ..request("a") }).err().unwrap();
    assert!(error.0.contains("no GPU to trace"), "{error}");
    assert!(world.calls.is_empty());
}

#[test]
fn inner_experiments_finish_first_and_a_finished_one_answers_with_its_report() {
    let mut world = Fake::default();
    let outer = lifecycle::open(&mut world, request("outer")).unwrap().id;
    let inner = lifecycle::open(&mut world, request("inner")).unwrap().id;
    let finished = lifecycle::finish(&mut world, outer, BTreeSet::new(), false).unwrap();
    let names: Vec<&str> = finished.reports.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["inner", "outer"]);
    assert_eq!(only(&world.calls, &["publish"]), [format!("publish {inner}"), format!("publish {outer}")]);

    world.calls.clear();
    let again = lifecycle::finish(&mut world, outer, BTreeSet::new(), false).unwrap();
    assert!(Arc::ptr_eq(&again.reports[0], &finished.reports[1]));
    assert!(!world.calls.iter().any(|c| c.starts_with("teardown")), "nothing more is deleted");
    assert_eq!(
        lifecycle::finish(&mut world, 99, BTreeSet::new(), false).err(),
        Some(Failed("no experiment scope with id 99".into()))
    );
}

#[test]
fn during_a_reset_the_teardown_leaves_the_names_and_the_report_says_why() {
    let mut world = Fake::default();
    let id = lifecycle::open(&mut world, request("a")).unwrap().id;
    let finished = lifecycle::finish(&mut world, id, BTreeSet::new(), true).unwrap();
    assert!(only(&world.calls, &["teardown"])[0].contains("names=false"));
    assert!(finished.reports[0].notes.iter().any(|n| n.starts_with("finished by %reset")));
}

#[test]
fn failed_cleanup_steps_become_notes_and_the_report_is_still_recorded() {
    let mut world = Fake { failing: Some("restore_limit"), ..Fake::default() };
    let id = lifecycle::open(&mut world, request("a")).unwrap().id;
    world.failing = Some("hunt_leaks");
    let finished = lifecycle::finish(&mut world, id, BTreeSet::new(), false).unwrap();
    assert!(finished.reports[0].notes.iter().any(|n| n == "the leak hunt failed: hunt_leaks failed"));
    assert!(world.calls.ends_with(&["release_interrupts".to_string(), format!("publish {id}")]));
}

#[test]
fn what_publishing_adds_is_in_the_report_handed_back_and_in_the_history() {
    let mut world = Fake { publish_note: Some("the store did not answer"), ..Fake::default() };
    let id = lifecycle::open(&mut world, request("a")).unwrap().id;
    let finished = lifecycle::finish(&mut world, id, BTreeSet::new(), false).unwrap();
    assert!(finished.reports[0].notes.contains(&"the store did not answer".to_string()));
    assert!(Arc::ptr_eq(&finished.reports[0], &world.registry().report(id).unwrap()));
}

#[test]
fn one_waiting_behind_an_experiment_opened_inside_it_gets_one_collection_first() {
    let mut world = Fake::default();
    let outer = lifecycle::open(&mut world, request("outer")).unwrap().id;
    lifecycle::open(&mut world, request("inner")).unwrap();
    world.registry().dropped(outer, Dropped { by_collector: true, on_main_thread: true, in_shell: true });
    let finished = lifecycle::finish_unreachable(&mut world, SafePoint::CellEnd).unwrap();
    assert!(finished.reports.is_empty());
    assert_eq!(only(&world.calls, &["collect_garbage"]).len(), 1);
}

#[test]
fn a_live_report_measures_now_and_a_finished_one_is_the_final_one() {
    let mut world = Fake::default();
    let id = lifecycle::open(&mut world, request("a")).unwrap().id;
    world.calls.clear();
    assert!(lifecycle::report_now(&mut world, id).unwrap().host.rss.end.is_none());
    assert_eq!(world.calls, ["snapshot"]);
    let finished = lifecycle::finish(&mut world, id, BTreeSet::new(), false).unwrap();
    assert!(Arc::ptr_eq(&lifecycle::report_now(&mut world, id).unwrap(), &finished.reports[0]));
    assert!(lifecycle::report_now(&mut world, id + 1).is_none());
}

#[test]
fn a_forked_child_forgets_every_experiment_and_never_drops_their_handles() {
    let dropped = Arc::new(AtomicBool::new(false));
    let mut world = Fake { dropped: Some(dropped.clone()), ..Fake::default() };
    let id = lifecycle::open(&mut world, request("a")).unwrap().id;
    lifecycle::forget_in_child(&mut world.registry());
    assert!(world.registry().scope(id).is_none() && world.registry().history().is_empty());
    assert!(!dropped.load(Ordering::SeqCst), "the parent's pins are forgotten, not dropped");
}

#[test]
fn handles_go_when_the_teardown_takes_them() {
    let dropped = Arc::new(AtomicBool::new(false));
    let mut world = Fake { dropped: Some(dropped.clone()), ..Fake::default() };
    let id = lifecycle::open(&mut world, request("a")).unwrap().id;
    assert!(!dropped.load(Ordering::SeqCst));
    lifecycle::finish(&mut world, id, BTreeSet::new(), false).unwrap();
    assert!(dropped.load(Ordering::SeqCst));
    assert!(world.registry().attached::<Handles>(id).is_none());
}

#[test]
fn every_step_is_in_its_order_once() {
    for (i, step) in OPEN.iter().enumerate() {
        assert!(!OPEN[i + 1..].contains(step), "{step:?} twice");
    }
    for (i, step) in FINISH.iter().enumerate() {
        assert!(!FINISH[i + 1..].contains(step), "{step:?} twice");
    }
    let at = |step| OPEN.iter().position(|s| *s == step).unwrap();
    assert!(at(OpenStep::PreparePublishing) < at(OpenStep::HoldInterrupts), "a store may wait");
    assert!(at(OpenStep::Pin) < at(OpenStep::StartSnapshot), "the pins are not the experiment's memory");
    assert!(at(OpenStep::StartTrace) < at(OpenStep::StartSnapshot), "a trace's CUDA context is no experiment's");
    assert_eq!(OPEN[OPEN.len() - 2..], [OpenStep::ReleaseInterrupts, OpenStep::Publish]);
}
