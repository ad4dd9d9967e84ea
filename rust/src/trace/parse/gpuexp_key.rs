//! The `gpuexp` key that gpuexp saves in a snapshot (its opening state, the experiment's window,
//! its step marks: see `opening.rs`), read back; absent from torch's own files.

use super::builder::Builder;
use super::fields::int;
use super::{Gpuexp, Opening, Window};
use crate::trace::marks::{Recorded, StepMark};
use crate::trace::pickle::Value;

impl Builder<'_> {
    /// The `gpuexp` key (see `opening`); what is missing or malformed reads as absent.
    pub(super) fn gpuexp(&mut self, key: &Value) -> Gpuexp {
        let cap =
            |value: &Value| value.get("max_entries").and_then(|m| m.as_int()).and_then(|m| usize::try_from(m).ok());
        let opening = key.get("opening").filter(|o| matches!(o, Value::Dict(_))).map(|opening| Opening {
            time_us: int(&opening, "time_us"),
            max_entries: cap(&opening),
            segments: opening
                .get("segments")
                .map(|s| s.items())
                .unwrap_or_default()
                .iter()
                .map_while(|s| self.segment(s))
                .collect(),
        });
        let window = key.get("window").filter(|w| matches!(w, Value::Dict(_))).map(|window| Window {
            opened_us: int(&window, "opened_us"),
            max_entries: cap(&window),
            peaks: (window.get("peaks").map(|p| p.items()).unwrap_or_default().iter())
                .map(|peak| (int(peak, "device").max(0) as usize, int(peak, "max_memory_allocated").max(0) as u64))
                .collect(),
        });
        let steps = key.get("steps").filter(|s| matches!(s, Value::List(_))).map(|steps| {
            (steps.items().iter())
                .filter_map(|mark| {
                    let recorded = Recorded::parse(mark.get("recorded")?.as_str()?)?;
                    Some(StepMark { time_us: int(mark, "time_us"), recorded })
                })
                .collect()
        });
        Gpuexp { opening, window, steps }
    }
}
