//! How an estimate runs its step under fake tensors: on which memory, a second call when the
//! first created the optimizer's state, why it failed, and notes on what the fakes could not show.

use crate::holders_walk::Memory;

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
/// first one).
pub fn failed_at(operator: Option<&str>, kind: &str, message: &str) -> String {
    format!(
        "no estimate was made: the step failed under fake tensors at {} ({kind}: {})",
        operator.unwrap_or("its first operator"),
        message.lines().next().unwrap_or("")
    )
}

/// A real tensor that requires grad would tie the step's graph to the real model, and backward
/// would set its `.grad` to a fake: a parameter of `shape` that the walk did not find.
pub fn unknown_parameter(shape: &str) -> String {
    format!(
        "no estimate was made: the step uses a tensor that requires grad ({shape}) that is in no module or \
         optimizer reachable from the step or your names; make the model a global or a closure variable of the step"
    )
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

    fn calls(created: &[bool], most: u32) -> (u32, Vec<String>) {
        let mut answers = created.iter();
        call_step(most, || Ok::<_, ()>(*answers.next().expect("called past the answers"))).unwrap()
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
        let failed = failed_at(Some("aten.geqrf.default"), "UnsupportedOperatorException", "geqrf\nmore");
        assert!(failed.ends_with("at aten.geqrf.default (UnsupportedOperatorException: geqrf)"), "{failed}");
        assert!(failed_at(None, "TypeError", "").contains("at its first operator (TypeError: )"));
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
