use std::cell::RefCell;
use std::sync::Mutex;

use super::*;

/// The lease is per process: the tests that use it take turns.
static TURN: Mutex<()> = Mutex::new(());

/// A torch that logs what it was asked to do.
#[derive(Default)]
struct Fake {
    user_recording: bool,
    cuda_initialised: bool,
    record_fails: bool,
    missing: Option<Missing>,
    calls: RefCell<Vec<String>>,
}

impl Fake {
    fn log(&self, call: &str) {
        self.calls.borrow_mut().push(call.into());
    }
    fn calls(&self) -> Vec<String> {
        self.calls.borrow_mut().drain(..).collect()
    }
}

impl TorchMemory for Fake {
    fn available(&self) -> Result<(), Missing> {
        self.missing.clone().map_or(Ok(()), Err)
    }
    fn history_enabled(&self) -> bool {
        self.user_recording
    }
    fn cuda_initialised(&self) -> bool {
        self.cuda_initialised
    }
    fn init_cuda(&self) -> Result<(), String> {
        self.log("init cuda");
        Ok(())
    }
    fn record(&self, mode: Option<HistoryMode>) -> Result<(), String> {
        self.log(&format!("record {mode:?}"));
        if self.record_fails {
            return Err("refused".into());
        }
        Ok(())
    }
    fn take_opening(&self, _time_us: i64) {
        self.log("take opening");
    }
    fn forget_opening(&self) {
        self.log("forget opening");
    }
    fn module_paths(&self, install: bool) -> Result<Option<String>, String> {
        self.log(if install { "hooks on" } else { "hooks off" });
        Ok(None)
    }
}

#[test]
fn a_traced_experiment_starts_and_stops_the_recording_in_order() {
    let _turn = crate::locks::lock(&TURN);
    let torch = Fake { cuda_initialised: true, ..Fake::default() };
    let (window, notes) = open(&torch);
    assert_eq!(window.unavailable, None);
    assert_eq!(window.max_entries, Some(MAX_ENTRIES));
    assert!(notes.is_empty(), "{notes:?}");
    assert_eq!(torch.calls(), ["hooks on", "take opening", "record Some(Stacks)"]);
    assert_eq!(open_shares(), 1);
    assert_eq!(close(&torch), None);
    assert_eq!(torch.calls(), ["hooks off", "forget opening", "record None"]);
    assert_eq!(open_shares(), 0);
}

#[test]
fn the_users_recording_is_shared_and_never_stopped() {
    let _turn = crate::locks::lock(&TURN);
    let torch = Fake { cuda_initialised: true, user_recording: true, ..Fake::default() };
    let (window, notes) = open(&torch);
    assert_eq!(window.max_entries, None);
    assert!(notes.iter().any(|n| n.contains("leaves it as it was")), "{notes:?}");
    assert!(set_stacks(&torch, false), "the user's recording keeps its stacks");
    assert_eq!(close(&torch), None);
    assert!(torch.calls().iter().all(|c| !c.starts_with("record")));
}

#[test]
fn cuda_is_initialised_before_the_recording_starts() {
    let _turn = crate::locks::lock(&TURN);
    let torch = Fake::default();
    let (_, notes) = open(&torch);
    assert!(notes.iter().any(|n| n.contains("initialised CUDA")), "{notes:?}");
    assert_eq!(torch.calls()[0], "init cuda");
    close(&torch);
}

#[test]
fn a_failed_start_counts_no_client_and_forgets_the_opening() {
    let _turn = crate::locks::lock(&TURN);
    let torch = Fake { cuda_initialised: true, record_fails: true, ..Fake::default() };
    let (window, _) = open(&torch);
    assert!(window.unavailable.is_some_and(|why| why.contains("did not start recording")));
    assert_eq!(torch.calls(), ["hooks on", "take opening", "record Some(Stacks)", "forget opening", "hooks off"]);
    assert_eq!(open_shares(), 0);
}

#[test]
fn no_torch_says_what_to_trace_instead() {
    let _turn = crate::locks::lock(&TURN);
    let torch = Fake { missing: Some(Missing::Torch), ..Fake::default() };
    let (window, _) = open(&torch);
    assert!(window.unavailable.is_some_and(|why| why.contains("trace=\"host\"")));
    assert!(torch.calls().is_empty());
    assert!(join(&torch, HistoryMode::Events).is_err());
}

#[test]
fn unsampled_steps_record_events_and_take_the_hooks_off() {
    let _turn = crate::locks::lock(&TURN);
    let torch = Fake { cuda_initialised: true, ..Fake::default() };
    open(&torch);
    torch.calls();
    assert!(!set_stacks(&torch, false));
    assert_eq!(torch.calls(), ["record Some(Events)", "hooks off"]);
    assert!(set_stacks(&torch, true));
    assert_eq!(torch.calls(), ["record Some(Stacks)", "hooks on"]);
    close(&torch);
}

#[test]
fn the_flight_recorder_joins_once_without_stacks_and_leaves_once() {
    use crate::recorder::{change_history, HistoryChange};
    let _turn = crate::locks::lock(&TURN);
    let torch = Fake { cuda_initialised: true, ..Fake::default() };
    assert_eq!(change_history(&torch, HistoryChange::Join), None);
    assert_eq!(change_history(&torch, HistoryChange::Join), None);
    assert_eq!(torch.calls(), ["take opening", "record Some(Events)"], "joined once, without hooks");
    change_history(&torch, HistoryChange::Leave);
    change_history(&torch, HistoryChange::Leave);
    assert_eq!(torch.calls(), ["forget opening", "record None"]);
}
