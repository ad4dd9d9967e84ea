//! How an estimate runs its step under fake tensors: on which memory, in which order (the state
//! saved, the fakes swapped in, the step run under the ledger, everything put back), a second
//! call when the first created the optimizer's state, why it failed, and notes on what the fakes
//! could not show.

use crate::estimate::{Peak, Room, Rounding};
use crate::holders_walk::Memory;
use crate::scalar_reads::OnFakes;
use crate::snapshot::host;

/// What one estimate found: the ledger's peak, how many calls of the step it ran, and notes.
#[derive(Debug, PartialEq)]
pub struct Run {
    pub peak: Peak,
    pub calls: u32,
    pub notes: Vec<String>,
}

/// What the step's run under the ledger found: the peak, and the calls made with their notes.
pub type Ran = (Peak, (u32, Vec<String>));

/// The world of one estimate, a method per step; [`run`] calls them in their fixed order.
pub trait Estimating {
    type Error;
    /// Saves every container the step reaches, to be put back whatever happens.
    fn save_state(&mut self) -> Result<(), Self::Error>;
    /// Swaps the model's tensors for fakes (on an error, none stays swapped); what the swap met.
    fn swap_in_fakes(&mut self) -> Result<Swapped, Self::Error>;
    /// Runs the step under the ledger, its calls made by [`call_step`]: the peak, the calls and
    /// their notes.
    fn run_ledger(&mut self) -> Result<Ran, Self::Error>;
    /// Puts the real tensors back.
    fn swap_out_fakes(&mut self) -> Result<(), Self::Error>;
    /// Puts back every container the step changed: notes on what could not be.
    fn restore_state(&mut self) -> Result<Vec<String>, Self::Error>;
    /// `error`, saying also what was not put back (`left`).
    fn not_restored(&self, error: Self::Error, left: Vec<String>) -> Self::Error;
}

/// One estimate on `device` ("cuda:0", "host"): the state is saved first and put back last,
/// whatever happened between; fakes swapped in are swapped out before it.
pub fn run<W: Estimating>(world: &mut W, device: &str) -> Result<Run, W::Error> {
    world.save_state()?;
    let run = run_on_fakes(world, device);
    let left = world.restore_state()?;
    match run {
        Ok(mut run) => {
            run.notes.extend(left);
            Ok(run)
        }
        Err(error) if !left.is_empty() => Err(world.not_restored(error, left)),
        Err(error) => Err(error),
    }
}

fn run_on_fakes<W: Estimating>(world: &mut W, device: &str) -> Result<Run, W::Error> {
    let swapped = world.swap_in_fakes()?;
    let on_fakes = OnFakes::enter();
    let ran = world.run_ledger();
    drop(on_fakes);
    let swapped_out = world.swap_out_fakes();
    let (peak, (calls, mut notes)) = ran?;
    swapped_out?;
    notes.extend(swapped.notes(device));
    Ok(Run { peak, calls, notes })
}

/// Why an estimate can't start.
#[derive(Debug, PartialEq, Eq)]
pub enum Unready {
    /// Torch is not imported: there are no fake tensors and no model.
    NoTorch(String),
    /// A GPU was named, and torch has not initialised CUDA.
    NoCuda(String),
}

/// Which memory an estimate counts: a GPU torch has initialised (fake CUDA tensors need one), or
/// with no `device`, the host.
pub fn memory(torch: bool, cuda_initialised: bool, device: Option<u32>) -> Result<Memory, Unready> {
    if !torch {
        return Err(Unready::NoTorch(
            "estimate runs the step under torch's fake tensors: import torch and build the model first".into(),
        ));
    }
    match device {
        None => Ok(Memory::Host),
        Some(index) if cuda_initialised => Ok(Memory::Cuda(index)),
        Some(index) => Err(Unready::NoCuda(format!(
            "device=cuda:{index}: torch has not initialised CUDA, so nothing of the step is on the GPU; \
             move the model there first, or estimate on device='cpu'"
        ))),
    }
}

/// How the allocator of `memory` sizes a storage: a GPU's caching allocator, or the host exactly.
pub fn rounding(memory: &Memory) -> Rounding {
    match memory {
        Memory::Cuda(_) => Rounding::CudaCaching,
        _ => Rounding::Exact,
    }
}

/// What a GPU leaves the step: torch's `allocated` now, and NVML's `free` (None: unreadable)
/// plus torch's cache (`reserved` less `allocated`); against `limit=` too.
pub fn gpu_room(device: String, allocated: u64, reserved: u64, free: Option<u64>, limit: Option<u64>) -> Room {
    let cache = reserved.saturating_sub(allocated);
    Room { device, now: allocated, free: free.map(|f| f + cache), limit }
}

/// What the host leaves the step: its available memory, with the process's RSS in use now.
pub fn host_room(limit: Option<u64>) -> Room {
    let reading = host::read();
    Room { device: "cpu".into(), now: reading.rss, free: Some(reading.available), limit }
}

/// Why no estimate was made: the model's tensors could not be swapped for fakes (`why`).
pub fn not_swapped(why: &str) -> String {
    format!("no estimate was made: the model's tensors could not be swapped for fakes ({why})")
}

/// Calls the step (`call` answers whether that call created optimizer state) until a call
/// creates none or `most` calls are made: later steps hold that state through their forward
/// pass. The calls made, and a note when the last still created state.
pub fn call_step<E>(most: u32, mut call: impl FnMut() -> Result<bool, E>) -> Result<(u32, Vec<String>), E> {
    let mut made = 0;
    loop {
        made += 1;
        let created_state = call()?;
        if !created_state || made >= most {
            let note = "this call created the optimizer's state: later steps hold it all along, \
                        which estimate(..., steps=2) includes";
            return Ok((made, created_state.then(|| note.to_string()).into_iter().collect()));
        }
    }
}

/// Why no estimate was made: the step raised (`kind`: `message`) at `operator` (None: before its
/// first one), or, where the user's own code raised it, at `raised_at` (its file and line, the
/// innermost frame outside torch and gpuexp), which the message starts with.
pub fn failed_at(operator: Option<&str>, kind: &str, message: &str, raised_at: Option<&str>) -> String {
    let first = message.lines().next().unwrap_or("");
    if let Some(other) = meta_beside(kind, first) {
        return meta_mixed(operator.unwrap_or("its first operator"), other);
    }
    if let Some(place) = raised_at {
        let error = if first.is_empty() { kind.to_string() } else { format!("{kind}: {first}") };
        return format!("{error} at {place}; no estimate was made: the step raised it under fake tensors");
    }
    format!(
        "no estimate was made: the step failed under fake tensors at {} ({kind}: {})",
        operator.unwrap_or("its first operator"),
        first
    )
}

/// The device that torch's fake-tensor mismatch found beside `meta` ("found at least two devices,
/// meta and cpu!"), where it names meta.
fn meta_beside<'m>(kind: &str, message: &'m str) -> Option<&'m str> {
    if kind != "FakeTensorDeviceMismatchError" {
        return None;
    }
    let devices = message.rsplit_once("devices, ")?.1.trim_end_matches(['!', '.']);
    match devices.split_once(" and ")? {
        ("meta", other) | (other, "meta") if other != "meta" => Some(other),
        _ => None,
    }
}

/// Why no estimate was made of a step that mixes `meta` tensors with tensors on `device` (the
/// one estimated for): the model's own tensors on meta count as loaded there, so the meta one is
/// a tensor the step made on meta (a device read from the model before the step) or one that no
/// module holds. What to do instead, in both ways.
fn meta_mixed(operator: &str, device: &str) -> String {
    format!(
        "no estimate was made: the step mixes a tensor on the meta device with tensors on {device} at {operator}. \
         The model's parameters, buffers and optimizer state on meta count as loaded onto {device}, but a tensor \
         the step makes on meta (with a device read from the model before the step) or one no module holds stays \
         there, without data. Make the step's tensors on the device estimated for \
         (torch.randn(..., device='{device}'), or the device of a parameter read inside the step), or materialise \
         the model first: model.to_empty(device='{device}'), then load its weights with model.load_state_dict(...)"
    )
}

/// A real tensor that requires grad would tie the step's graph to the real model, and backward
/// would set its `.grad` to a fake: one of `shape` that no module holds as a parameter, named by
/// `path` (`model.head.extra`, `cache['k']`) where the step reaches it.
pub fn unknown_parameter(path: Option<&str>, shape: &str) -> String {
    match path {
        Some(path) => format!(
            "no estimate was made: the step uses {path}, a tensor that requires grad ({shape}) that is no \
             registered parameter of a module; register it on its module (module.name = nn.Parameter(...)) \
             so that the estimate swaps it for a fake, or detach it"
        ),
        None => format!(
            "no estimate was made: the step uses a tensor that requires grad ({shape}) that is in no module or \
             optimizer reachable from the step or your names; make the model a global or a closure variable of \
             the step"
        ),
    }
}

/// What the swap to fakes met that changes what the estimate means.
#[derive(Clone, Copy, Debug, Default)]
pub struct Swapped {
    /// An attention module in eval mode: at inference its fast path would have run.
    pub fastpath_skipped: bool,
    /// Tensors on the `meta` device, counted as loaded before the step.
    pub loaded: usize,
    /// GradScalers told that the gradients are finite.
    pub scalers: usize,
}

impl Swapped {
    /// The notes for an estimate on `device` ("cuda:0", "host").
    pub fn notes(&self, device: &str) -> Vec<String> {
        let mut notes = Vec::new();
        if self.fastpath_skipped {
            notes.push(
                "attention's fast path (nested tensors) can't run under fake tensors: this is the peak of the \
                 regular path, which needs more where the fast path drops padding"
                    .into(),
            );
        }
        if self.loaded > 0 {
            notes.push(format!(
                "{} tensors are on the meta device: they count as loaded onto {device} before the step",
                self.loaded
            ));
        }
        if self.scalers > 0 {
            notes.push(
                "GradScaler: estimated as a step whose gradients are finite, so that the optimizer steps \
                 (the step that needs the memory)"
                    .into(),
            );
        }
        notes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tensor_that_requires_grad_is_named_by_its_path_where_the_step_reaches_it() {
        let named = unknown_parameter(Some("model.head.extra"), "torch.Size([3])");
        assert!(
            named.contains("the step uses model.head.extra, a tensor that requires grad (torch.Size([3]))"),
            "{named}"
        );
        assert!(named.contains("nn.Parameter"), "{named}");
        let unnamed = unknown_parameter(None, "torch.Size([3])");
        assert!(unnamed.contains("a tensor that requires grad (torch.Size([3])) that is in no module"), "{unnamed}");
    }
    use crate::estimate::{Ledger, Rounding};

    /// Records each step of an estimate; fails at `failing`, and leaves `left` unrestored.
    #[derive(Default)]
    struct Recorded {
        steps: Vec<&'static str>,
        failing: Option<&'static str>,
        left: Vec<String>,
    }

    impl Recorded {
        fn step(&mut self, name: &'static str) -> Result<(), String> {
            // `gpuexp.estimating()` answers true while the step runs on fakes, and only then.
            assert_eq!(crate::scalar_reads::estimating(), name == "run ledger", "{name}");
            self.steps.push(name);
            if self.failing == Some(name) {
                return Err(format!("{name} failed"));
            }
            Ok(())
        }
    }

    impl Estimating for Recorded {
        type Error = String;
        fn save_state(&mut self) -> Result<(), String> {
            self.step("save state")
        }
        fn swap_in_fakes(&mut self) -> Result<Swapped, String> {
            self.step("swap in fakes").map(|()| Swapped { scalers: 1, ..Swapped::default() })
        }
        fn run_ledger(&mut self) -> Result<Ran, String> {
            self.step("run ledger").map(|()| (Ledger::new(Rounding::Exact).peak(), (2, vec!["ran".into()])))
        }
        fn swap_out_fakes(&mut self) -> Result<(), String> {
            self.step("swap out fakes")
        }
        fn restore_state(&mut self) -> Result<Vec<String>, String> {
            self.step("restore state").map(|()| self.left.clone())
        }
        fn not_restored(&self, error: String, left: Vec<String>) -> String {
            format!("{error}; {}", left.join("; "))
        }
    }

    #[test]
    fn a_meta_tensor_beside_the_estimated_device_names_both_fixes() {
        for message in [
            "Expected all tensors to be on the same device, but found at least two devices, meta and cpu!",
            "Expected all tensors to be on the same device, but found at least two devices, cpu and meta!",
        ] {
            let said = failed_at(Some("aten.mm.default"), "FakeTensorDeviceMismatchError", message, None);
            assert!(said.starts_with("no estimate was made: the step mixes a tensor on the meta device"), "{said}");
            assert!(said.contains("on cpu at aten.mm.default") && said.contains("device='cpu'"), "{said}");
            assert!(said.contains("model.to_empty(device='cpu')") && said.contains("load_state_dict"), "{said}");
        }
        let other = "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!";
        let said = failed_at(Some("aten.mm.default"), "FakeTensorDeviceMismatchError", other, None);
        assert!(said.contains("(FakeTensorDeviceMismatchError: Expected") && !said.contains("meta"), "{said}");
    }

    const ORDER: [&str; 5] = ["save state", "swap in fakes", "run ledger", "swap out fakes", "restore state"];

    #[test]
    fn an_estimate_saves_swaps_runs_and_puts_back_in_that_order() {
        let mut world = Recorded { left: vec!["left".into()], ..Recorded::default() };
        let run = super::run(&mut world, "cuda:0").unwrap();
        assert_eq!(world.steps, ORDER);
        assert_eq!(run.calls, 2);
        assert_eq!(run.notes[0], "ran");
        assert!(run.notes[1].starts_with("GradScaler"), "{:?}", run.notes);
        assert_eq!(run.notes[2], "left", "what was not put back is noted last");
    }

    #[test]
    fn whatever_fails_what_was_done_is_undone() {
        for (failing, steps) in [
            ("run ledger", &ORDER[..]),
            ("swap in fakes", &["save state", "swap in fakes", "restore state"][..]),
            ("save state", &ORDER[..1]),
        ] {
            let mut world = Recorded { failing: Some(failing), ..Recorded::default() };
            assert_eq!(super::run(&mut world, "cpu"), Err(format!("{failing} failed")));
            assert_eq!(world.steps, steps, "{failing}");
        }
        let mut world = Recorded { failing: Some("run ledger"), left: vec!["a dict".into()], ..Recorded::default() };
        assert_eq!(super::run(&mut world, "cpu"), Err("run ledger failed; a dict".into()));
    }

    fn calls(created: &[bool], most: u32) -> (u32, Vec<String>) {
        let mut answers = created.iter();
        call_step(most, || Ok::<_, ()>(*answers.next().expect("called past the answers"))).unwrap()
    }

    #[test]
    fn a_gpu_leaves_its_free_memory_and_torchs_cache_and_rounds_as_its_allocator() {
        let room = gpu_room("cuda:0".into(), 100, 150, Some(1000), None);
        assert_eq!((room.now, room.free), (100, Some(1050)));
        assert_eq!(gpu_room("cuda:0".into(), 100, 150, None, Some(5)).free, None, "NVML unreadable");
        assert_eq!(rounding(&Memory::Cuda(0)), Rounding::CudaCaching);
        assert_eq!(rounding(&Memory::Host), Rounding::Exact);
    }

    #[test]
    fn an_estimate_needs_torch_and_on_a_gpu_its_context() {
        assert!(matches!(memory(false, true, Some(0)), Err(Unready::NoTorch(_))));
        assert_eq!(memory(true, false, None), Ok(Memory::Host));
        assert_eq!(memory(true, true, Some(1)), Ok(Memory::Cuda(1)));
        let Err(Unready::NoCuda(why)) = memory(true, false, Some(1)) else { panic!("a GPU without CUDA") };
        assert!(why.starts_with("device=cuda:1") && why.contains("device='cpu'"), "{why}");
    }

    #[test]
    fn a_call_that_created_optimizer_state_is_followed_by_another_up_to_the_most() {
        assert_eq!(calls(&[false], 2), (1, vec![]));
        assert_eq!(calls(&[true, false], 2), (2, vec![]));
        let (made, notes) = calls(&[true], 1);
        assert_eq!(made, 1);
        assert!(notes[0].contains("steps=2"), "{notes:?}");
        assert_eq!(calls(&[true, true], 2).1.len(), 1, "the last call still created state");
    }

    #[test]
    fn a_failed_call_stops_the_calls() {
        let mut made = 0;
        let failed = call_step(3, || {
            made += 1;
            if made == 2 {
                Err("no estimate")
            } else {
                Ok(true)
            }
        });
        assert_eq!((failed, made), (Err("no estimate"), 2));
    }

    #[test]
    fn a_failure_names_its_operator_and_the_first_line_of_its_error() {
        let failed = failed_at(Some("aten.geqrf.default"), "UnsupportedOperatorException", "geqrf\nmore", None);
        assert!(failed.ends_with("at aten.geqrf.default (UnsupportedOperatorException: geqrf)"), "{failed}");
        assert!(failed_at(None, "TypeError", "", None).contains("at its first operator (TypeError: )"));
    }

    #[test]
    fn the_users_own_error_comes_first_at_its_file_and_line() {
        let failed = failed_at(Some("aten.mm.default"), "KeyError", "'missing'", Some("train.py:12"));
        assert!(failed.starts_with("KeyError: 'missing' at train.py:12; no estimate was made"), "{failed}");
        assert!(failed_at(None, "StopIteration", "", Some("a.py:1")).starts_with("StopIteration at a.py:1;"));
    }

    #[test]
    fn each_thing_the_fakes_met_is_one_note() {
        assert!(Swapped::default().notes("cuda:0").is_empty());
        let all = Swapped { fastpath_skipped: true, loaded: 3, scalers: 1 };
        let notes = all.notes("cuda:1");
        assert_eq!(notes.len(), 3);
        assert!(notes[1].starts_with("3 tensors are on the meta device") && notes[1].contains("onto cuda:1"));
    }
}
