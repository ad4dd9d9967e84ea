//! The step marks gpuexp saves with a traced snapshot (the `gpuexp` key's `steps`): when each
//! step began and what the recording did from then on. Read by the parser, used by the replay's
//! sampling.

/// What the recording did from a step mark on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recorded {
    /// Python stacks (and module paths) at each allocation: a sampled step.
    Stacks,
    /// Sizes and times only: a step whose sites are mapped from a sampled one.
    Events,
    /// No traced experiment was open: whatever ran is not gpuexp's sampling.
    Outside,
}

impl Recorded {
    pub fn label(self) -> &'static str {
        match self {
            Recorded::Stacks => "stacks",
            Recorded::Events => "events",
            Recorded::Outside => "outside",
        }
    }

    pub fn parse(text: &str) -> Option<Recorded> {
        [Recorded::Stacks, Recorded::Events, Recorded::Outside].into_iter().find(|r| r.label() == text)
    }
}

/// A traced experiment's opening, a step's end or the last experiment's finish, in Unix
/// microseconds (torch's `time_us` clock), and what the recording did from then on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepMark {
    pub time_us: i64,
    pub recorded: Recorded,
}
