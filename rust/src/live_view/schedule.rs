//! When a running cell's live view is drawn: first once the cell has run `after` (2 s by
//! default), then at most twice a second until it ends. The one thread that draws it waits
//! here without the GIL. A cell's start does not wake it: between cells it looks every `after`,
//! which is soon enough to draw on time, so a cell that ends sooner never costs a thread switch.

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::locks::{lock, unpoisoned};

/// The shortest time between two drawings of a view.
pub const PERIOD: Duration = Duration::from_millis(500);
/// How long a cell runs before its live view shows, unless configured otherwise.
pub const DEFAULT_AFTER: Duration = Duration::from_secs(2);

/// A drawing that is due: the cell (its peak window) and whether the view is new.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tick {
    pub window: u64,
    pub first: bool,
}

#[derive(Debug)]
struct Running {
    window: u64,
    began: Instant,
    drawn: bool,
    /// When the next drawing may come, once one has been made.
    next: Option<Instant>,
}

#[derive(Debug)]
struct State {
    /// None: the live view is off.
    after: Option<Duration>,
    cell: Option<Running>,
    stopped: bool,
}

/// What the drawing thread does next.
#[derive(Debug, PartialEq, Eq)]
enum Due {
    Draw(Tick),
    WaitUntil(Instant),
    /// The live view is off: only a change of the setting can make a drawing due.
    WaitForTheSetting,
}

impl State {
    fn due(&self, now: Instant) -> Due {
        let Some(after) = self.after else { return Due::WaitForTheSetting };
        // Without a cell, look again after the delay: a cell that begins meanwhile is due no sooner.
        let Some(cell) = &self.cell else { return Due::WaitUntil(now + after) };
        let at = cell.next.unwrap_or(cell.began + after);
        if now >= at {
            Due::Draw(Tick { window: cell.window, first: !cell.drawn })
        } else {
            Due::WaitUntil(at)
        }
    }
}

pub struct Schedule {
    state: Mutex<State>,
    changed: Condvar,
}

impl Default for Schedule {
    fn default() -> Schedule {
        Schedule::new()
    }
}

/// This process's schedule, which the drawing thread of `gpuexp.live` waits on.
pub static SCHEDULE: Schedule = Schedule::new();

impl Schedule {
    pub const fn new() -> Schedule {
        Schedule {
            state: Mutex::new(State { after: Some(DEFAULT_AFTER), cell: None, stopped: false }),
            changed: Condvar::new(),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// How long a cell runs before its view shows; None: never.
    pub fn after(&self) -> Option<Duration> {
        self.state().after
    }

    pub fn set_after(&self, after: Option<Duration>) {
        self.state().after = after;
        self.changed.notify_all();
    }

    pub fn cell_began(&self, window: u64) {
        self.state().cell = Some(Running { window, began: Instant::now(), drawn: false, next: None });
    }

    /// The cell ended; returns its window if its view was drawn (and so must be replaced).
    pub fn cell_ended(&self) -> Option<u64> {
        self.state().cell.take().filter(|cell| cell.drawn).map(|cell| cell.window)
    }

    /// Whether `window` is the cell running now.
    pub fn is_running(&self, window: u64) -> bool {
        self.state().cell.as_ref().is_some_and(|cell| cell.window == window)
    }

    /// Blocks until a drawing is due and returns it, counting it as made; None once stopped.
    pub fn wait(&self) -> Option<Tick> {
        let mut state = self.state();
        loop {
            if state.stopped {
                return None;
            }
            let now = Instant::now();
            state = match state.due(now) {
                Due::Draw(tick) => {
                    let cell = state.cell.as_mut().expect("a tick has a cell");
                    cell.drawn = true;
                    cell.next = Some(now + PERIOD);
                    return Some(tick);
                }
                Due::WaitUntil(at) => unpoisoned(self.changed.wait_timeout(state, at - now)).0,
                Due::WaitForTheSetting => unpoisoned(self.changed.wait(state)),
            };
        }
    }

    /// Ends every wait, now and later (at interpreter exit).
    pub fn stop(&self) {
        self.state().stopped = true;
        self.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn running(began: Instant) -> State {
        State {
            after: Some(DEFAULT_AFTER),
            cell: Some(Running { window: 7, began, drawn: false, next: None }),
            stopped: false,
        }
    }

    #[test]
    fn a_view_is_due_once_the_cell_has_run_the_delay() {
        let t0 = Instant::now();
        let state = running(t0);
        assert_eq!(state.due(t0 + Duration::from_millis(1999)), Due::WaitUntil(t0 + DEFAULT_AFTER));
        assert_eq!(state.due(t0 + DEFAULT_AFTER), Due::Draw(Tick { window: 7, first: true }));
        assert_eq!(State { after: None, ..running(t0) }.due(t0 + DEFAULT_AFTER * 10), Due::WaitForTheSetting, "off");
        assert_eq!(
            State { cell: None, ..running(t0) }.due(t0),
            Due::WaitUntil(t0 + DEFAULT_AFTER),
            "no cell: look later"
        );
    }

    #[test]
    fn drawings_come_at_most_twice_a_second_and_stop_with_the_cell() {
        let schedule = Schedule::new();
        schedule.set_after(Some(Duration::ZERO));
        schedule.cell_began(3);
        let started = Instant::now();
        let ticks: Vec<Tick> = (0..3).map(|_| schedule.wait().expect("not stopped")).collect();
        let took = started.elapsed();
        assert_eq!(ticks.iter().map(|t| t.first).collect::<Vec<_>>(), [true, false, false]);
        assert!(ticks.iter().all(|t| t.window == 3));
        assert!(took >= PERIOD * 2 && took < PERIOD * 2 + Duration::from_millis(300), "{took:?}");
        assert!(schedule.is_running(3) && !schedule.is_running(4));
        assert_eq!(schedule.cell_ended(), Some(3), "its view was drawn");
        assert!(schedule.cell_ended().is_none() && !schedule.is_running(3));
    }

    #[test]
    fn a_cell_that_begins_while_the_thread_waits_is_drawn_on_time() {
        let schedule = std::sync::Arc::new(Schedule::new());
        schedule.set_after(Some(Duration::from_millis(300)));
        let waiter = {
            let schedule = schedule.clone();
            std::thread::spawn(move || (schedule.wait(), Instant::now()))
        };
        std::thread::sleep(Duration::from_millis(200)); // the thread looked at 0 and looks again at 300 ms
        let began = Instant::now();
        schedule.cell_began(5);
        let (tick, drawn_at) = waiter.join().unwrap();
        assert_eq!(tick, Some(Tick { window: 5, first: true }));
        let late = drawn_at - began;
        assert!(late >= Duration::from_millis(300) && late < Duration::from_millis(400), "{late:?}");
    }

    #[test]
    fn a_cell_that_ends_before_the_delay_is_never_drawn_and_stop_ends_the_wait() {
        let schedule = std::sync::Arc::new(Schedule::new());
        schedule.set_after(Some(Duration::from_millis(200)));
        let waiter = {
            let schedule = schedule.clone();
            std::thread::spawn(move || schedule.wait())
        };
        schedule.cell_began(1);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(schedule.cell_ended(), None, "ended before its delay: not drawn");
        std::thread::sleep(Duration::from_millis(300));
        schedule.stop();
        assert_eq!(waiter.join().unwrap(), None, "no tick for a cell that ended; stop ends the wait");
        schedule.cell_began(2);
        schedule.set_after(Some(Duration::ZERO));
        assert_eq!(schedule.wait(), None, "stopped for good");
    }
}
