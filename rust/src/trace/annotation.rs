//! What gpuexp adds to torch's snapshot under the key `gpuexp` (read back by `parse`), besides
//! the allocator's state at the recording's start (a Python object the bindings put in as it
//! is): the traced experiment the snapshot is saved for, and the step marks of sampled stacks.

use serde_json::{json, Map, Value};

use super::StepMark;

/// The traced experiment a snapshot is saved for: when it opened, the cap, torch's peaks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WindowKey {
    pub opened_us: i64,
    pub max_entries: Option<u64>,
    /// (torch index, `max_memory_allocated` over the experiment).
    pub peaks: Vec<(u32, u64)>,
}

/// The `gpuexp` key's `window` (where one is given) and `steps` (where there are marks).
pub fn annotation(window: Option<&WindowKey>, marks: &[StepMark]) -> Map<String, Value> {
    let mut key = Map::new();
    if let Some(window) = window {
        let peaks: Vec<Value> = (window.peaks.iter())
            .map(|&(device, bytes)| json!({"device": device, "max_memory_allocated": bytes}))
            .collect();
        key.insert(
            "window".into(),
            json!({"opened_us": window.opened_us, "max_entries": window.max_entries, "peaks": peaks}),
        );
    }
    if !marks.is_empty() {
        let steps: Vec<Value> =
            marks.iter().map(|mark| json!({"time_us": mark.time_us, "recorded": mark.recorded.label()})).collect();
        key.insert("steps".into(), Value::Array(steps));
    }
    key
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::Recorded;

    #[test]
    fn the_window_and_the_marks_are_written_as_the_parser_reads_them() {
        let window = WindowKey { opened_us: 5, max_entries: None, peaks: vec![(1, 2048)] };
        let marks = [StepMark { time_us: 7, recorded: Recorded::Stacks }];
        let key = Value::Object(annotation(Some(&window), &marks));
        assert_eq!(key["window"]["opened_us"], 5);
        assert_eq!(key["window"]["max_entries"], Value::Null);
        assert_eq!(key["window"]["peaks"][0], json!({"device": 1, "max_memory_allocated": 2048}));
        assert_eq!(key["steps"][0], json!({"time_us": 7, "recorded": Recorded::Stacks.label()}));
        assert!(annotation(None, &[]).is_empty(), "nothing to add: no key");
    }
}
