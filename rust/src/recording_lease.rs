//! One recording that several clients share: torch's CUDA allocation history (traced
//! experiments, the cell log's trace and the flight recorder) or tracemalloc (experiments that
//! trace the host). Each client joins with the mode it needs; the recording runs in the
//! strongest mode any client asked for, and gpuexp stops it after the last client leaves, so no
//! hook outlives gpuexp's active state (pytorch #153571: hooks left behind slow every later
//! allocation). A recording that was already running when the first client joined is the
//! user's (or a framework's): it is shared, never restarted in another mode and never stopped.
//!
//! A ceiling caps the mode whatever the clients asked for: sampled stacks run the history without
//! stacks on the training steps that are not sampled (`stack_sampling`), and the clients keep
//! their shares meanwhile.
//!
//! The lease only decides; the bindings start, switch and stop the real recording as told.

/// What torch's CUDA allocation history records, weakest first. Its cost is in the stacks: about
/// 2 µs a Python stack (torch's docs), a tenth of a launch-bound step's time; without stacks it
/// was within noise on every workload measured (issue 29).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum HistoryMode {
    /// Each allocation's size, address, stream and time, no stack: the flight recorder.
    Events,
    /// And the Python stack at each allocation and free: traced experiments and cells.
    Stacks,
}

/// What the binding must do to the real recording after the lease changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change<M> {
    /// Nothing: it already runs in a strong enough mode, or it is the user's.
    Keep,
    /// Start it in this mode.
    Start(M),
    /// Restart it in this mode: stronger when a client joined, weaker when one left.
    Switch(M),
    /// Stop it: gpuexp started it and its last client left.
    Stop,
}

/// Who runs the recording while clients hold it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Runner<M> {
    /// gpuexp, in this mode.
    Gpuexp(M),
    /// The user or a framework: it was running before gpuexp's first client joined.
    User,
}

/// The clients of one recording in one process, and who runs it (kept in a
/// [`crate::fork::PerProcess`]: a forked child's recording is not the parent's).
#[derive(Debug)]
pub struct Lease<M> {
    /// One entry per client's share, by the mode it asked for.
    clients: Vec<M>,
    runner: Option<Runner<M>>,
    /// The strongest mode gpuexp may run it in for now, whatever the clients asked for.
    ceiling: Option<M>,
}

impl<M: Copy + Ord> Lease<M> {
    pub const fn new() -> Lease<M> {
        Lease { clients: Vec::new(), runner: None, ceiling: None }
    }

    fn strongest(&self) -> Option<M> {
        self.clients.iter().copied().max()
    }

    /// The mode the clients ask for, under the ceiling.
    fn wanted(&self) -> Option<M> {
        let strongest = self.strongest()?;
        Some(self.ceiling.map_or(strongest, |ceiling| strongest.min(ceiling)))
    }

    /// Where gpuexp runs the recording in another mode than the one wanted now: switch to it.
    fn follow(&mut self) -> Change<M> {
        match (self.runner, self.wanted()) {
            (Some(Runner::Gpuexp(current)), Some(wanted)) if wanted != current => {
                self.runner = Some(Runner::Gpuexp(wanted));
                Change::Switch(wanted)
            }
            _ => Change::Keep,
        }
    }

    /// A client joins asking for `mode`; `running` tells whether a recording runs already (asked
    /// only when this is the first client: then it is the user's).
    pub fn join(&mut self, mode: M, running: impl FnOnce() -> bool) -> Change<M> {
        let first = self.runner.is_none() || self.clients.is_empty();
        self.clients.push(mode);
        if !first {
            return self.follow();
        }
        if running() {
            self.runner = Some(Runner::User);
            return Change::Keep;
        }
        let wanted = self.wanted().unwrap_or(mode);
        self.runner = Some(Runner::Gpuexp(wanted));
        Change::Start(wanted)
    }

    /// Caps the mode gpuexp runs the recording in (None: no cap), the clients' shares kept. A
    /// recording of the user's is never switched.
    pub fn set_ceiling(&mut self, ceiling: Option<M>) -> Change<M> {
        self.ceiling = ceiling;
        self.follow()
    }

    /// The binding could not carry out what `join` of `mode` told it to: the client is not
    /// counted, and the recording stays as it was (stopped, or in its earlier mode).
    pub fn join_failed(&mut self, mode: M) {
        self.remove(mode);
        self.runner = match (self.runner, self.wanted()) {
            (_, None) => None,
            (Some(Runner::Gpuexp(_)), Some(wanted)) => Some(Runner::Gpuexp(wanted)),
            (runner, Some(_)) => runner,
        };
    }

    fn remove(&mut self, mode: M) -> bool {
        match self.clients.iter().position(|&m| m == mode) {
            Some(index) => {
                self.clients.swap_remove(index);
                true
            }
            None => false,
        }
    }

    /// A client of `mode` leaves. A leave without its join changes nothing. Once the last one
    /// left, no ceiling outlives it.
    pub fn leave(&mut self, mode: M) -> Change<M> {
        if !self.remove(mode) {
            return Change::Keep;
        }
        if self.clients.is_empty() {
            self.ceiling = None;
            let stop = matches!(self.runner, Some(Runner::Gpuexp(_)));
            self.runner = None;
            return if stop { Change::Stop } else { Change::Keep };
        }
        self.follow()
    }

    /// The recording gpuexp started was stopped and started again by someone else (the user's
    /// code, say, restarting tracemalloc): it is theirs from now on, and left running.
    pub fn disown(&mut self) {
        if matches!(self.runner, Some(Runner::Gpuexp(_))) {
            self.runner = Some(Runner::User);
        }
    }

    /// How many clients hold a share.
    pub fn clients(&self) -> usize {
        self.clients.len()
    }

    /// How many clients asked for `mode`.
    pub fn clients_of(&self, mode: M) -> usize {
        self.clients.iter().filter(|&&m| m == mode).count()
    }

    /// Whether gpuexp started the recording that runs now (false: none, or the user's).
    pub fn started_by_gpuexp(&self) -> bool {
        matches!(self.runner, Some(Runner::Gpuexp(_)))
    }

    /// The mode gpuexp runs it in (None: not running, or the user's, whose settings are unknown).
    pub fn mode(&self) -> Option<M> {
        match self.runner {
            Some(Runner::Gpuexp(mode)) => Some(mode),
            _ => None,
        }
    }
}

impl<M: Copy + Ord> Default for Lease<M> {
    fn default() -> Lease<M> {
        Lease::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ordered as the history's modes are: without stacks, then with them.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
    enum Mode {
        Plain,
        Stacks,
    }

    fn never() -> bool {
        panic!("asked whether a recording runs while gpuexp's clients hold it")
    }

    #[test]
    fn a_recording_restarted_by_someone_else_is_theirs_and_left_running() {
        let mut lease = Lease::new();
        assert_eq!(lease.join(Mode::Stacks, || false), Change::Start(Mode::Stacks));
        assert_eq!(lease.join(Mode::Stacks, never), Change::Keep);
        lease.disown();
        assert!(!lease.started_by_gpuexp());
        assert_eq!(lease.leave(Mode::Stacks), Change::Keep);
        assert_eq!(lease.leave(Mode::Stacks), Change::Keep, "the last client leaves it running");
        assert_eq!(lease.join(Mode::Stacks, || false), Change::Start(Mode::Stacks), "a fresh lease after");
    }

    #[test]
    fn the_first_client_starts_it_and_the_last_one_to_leave_stops_it() {
        let mut lease = Lease::new();
        assert_eq!(lease.join(Mode::Plain, || false), Change::Start(Mode::Plain));
        assert_eq!(lease.join(Mode::Plain, never), Change::Keep);
        assert_eq!(lease.clients(), 2);
        assert_eq!(lease.leave(Mode::Plain), Change::Keep);
        assert_eq!(lease.leave(Mode::Plain), Change::Stop);
        assert_eq!(lease.clients(), 0);
        assert!(!lease.started_by_gpuexp());
        // A second leave, without a join, changes nothing.
        assert_eq!(lease.leave(Mode::Plain), Change::Keep);
    }

    #[test]
    fn it_runs_in_the_strongest_mode_asked_for_and_steps_down_when_that_client_leaves() {
        let mut lease = Lease::new();
        assert_eq!(lease.join(Mode::Plain, || false), Change::Start(Mode::Plain));
        assert_eq!(lease.join(Mode::Stacks, never), Change::Switch(Mode::Stacks));
        assert_eq!(lease.join(Mode::Stacks, never), Change::Keep);
        assert_eq!(lease.join(Mode::Plain, never), Change::Keep);
        assert_eq!(lease.mode(), Some(Mode::Stacks));
        assert_eq!(lease.clients_of(Mode::Stacks), 2);
        assert_eq!(lease.leave(Mode::Stacks), Change::Keep);
        assert_eq!(lease.leave(Mode::Stacks), Change::Switch(Mode::Plain));
        assert_eq!(lease.leave(Mode::Plain), Change::Keep);
        assert_eq!(lease.leave(Mode::Plain), Change::Stop);
        // The strong client first: the weak one that follows leaves it as it is.
        assert_eq!(lease.join(Mode::Stacks, || false), Change::Start(Mode::Stacks));
        assert_eq!(lease.join(Mode::Plain, never), Change::Keep);
        assert_eq!(lease.leave(Mode::Stacks), Change::Switch(Mode::Plain));
        assert_eq!(lease.leave(Mode::Plain), Change::Stop);
    }

    #[test]
    fn a_users_recording_is_shared_and_never_switched_or_stopped() {
        let mut lease = Lease::new();
        assert_eq!(lease.join(Mode::Plain, || true), Change::Keep);
        assert!(!lease.started_by_gpuexp());
        assert_eq!(lease.mode(), None);
        assert_eq!(lease.join(Mode::Stacks, never), Change::Keep);
        assert_eq!(lease.leave(Mode::Stacks), Change::Keep);
        assert_eq!(lease.leave(Mode::Plain), Change::Keep);
        // Once all left, the next first client asks again: this time none runs.
        assert_eq!(lease.join(Mode::Stacks, || false), Change::Start(Mode::Stacks));
        assert!(lease.started_by_gpuexp());
    }

    #[test]
    fn a_failed_start_or_switch_leaves_the_recording_as_it_was() {
        let mut lease = Lease::new();
        assert_eq!(lease.join(Mode::Stacks, || false), Change::Start(Mode::Stacks));
        lease.join_failed(Mode::Stacks);
        assert_eq!((lease.clients(), lease.mode()), (0, None));
        assert_eq!(lease.join(Mode::Plain, || false), Change::Start(Mode::Plain));
        assert_eq!(lease.join(Mode::Stacks, never), Change::Switch(Mode::Stacks));
        lease.join_failed(Mode::Stacks);
        assert_eq!((lease.clients(), lease.mode()), (1, Some(Mode::Plain)));
        assert_eq!(lease.leave(Mode::Plain), Change::Stop);
    }

    #[test]
    fn a_ceiling_steps_the_recording_down_while_the_clients_keep_their_shares() {
        let mut lease = Lease::new();
        assert_eq!(lease.join(Mode::Plain, || false), Change::Start(Mode::Plain));
        assert_eq!(lease.join(Mode::Stacks, never), Change::Switch(Mode::Stacks));
        assert_eq!(lease.set_ceiling(Some(Mode::Plain)), Change::Switch(Mode::Plain));
        assert_eq!(lease.set_ceiling(Some(Mode::Plain)), Change::Keep);
        // A client joining under the ceiling is capped too.
        assert_eq!(lease.join(Mode::Stacks, never), Change::Keep);
        assert_eq!(lease.mode(), Some(Mode::Plain));
        assert_eq!(lease.clients_of(Mode::Stacks), 2);
        assert_eq!(lease.set_ceiling(None), Change::Switch(Mode::Stacks));
        assert_eq!(lease.leave(Mode::Stacks), Change::Keep);
        assert_eq!(lease.set_ceiling(Some(Mode::Plain)), Change::Switch(Mode::Plain));
        // The last client with stacks leaves under the ceiling: the mode is already right.
        assert_eq!(lease.leave(Mode::Stacks), Change::Keep);
        assert_eq!(lease.leave(Mode::Plain), Change::Stop);
        // The ceiling went with the last client: the next traced client gets its stacks.
        assert_eq!(lease.join(Mode::Stacks, || false), Change::Start(Mode::Stacks));
        assert_eq!(lease.leave(Mode::Stacks), Change::Stop);
    }

    #[test]
    fn a_ceiling_never_switches_a_users_recording() {
        let mut lease = Lease::new();
        assert_eq!(lease.join(Mode::Stacks, || true), Change::Keep);
        assert_eq!(lease.set_ceiling(Some(Mode::Plain)), Change::Keep);
        assert_eq!(lease.mode(), None);
        assert_eq!(lease.set_ceiling(None), Change::Keep);
        assert_eq!(lease.leave(Mode::Stacks), Change::Keep);
    }
}
