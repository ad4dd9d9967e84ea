//! What a step reaches, saved before `estimate` runs it under fake tensors and put back after
//! it: the one mechanism for it. Every container reachable from the step (a GradScaler, an LR
//! scheduler, an EMA copy, a metric accumulator, any attribute or container it assigns to, a
//! module's parameter, buffer and hook dicts, an optimizer's state and param groups), the places
//! its roots are held in (the globals it loads and assigns, its closure cells), and the four RNGs
//! are saved, by the identity of what they hold; after the step each is put back where it
//! changed. Run under fake tensors, the step would otherwise leave fakes there (and a scheduler
//! advanced, an RNG drawn from), and the next real step would fail on them. The fakes that stand
//! in for the real tensors while the step runs are swapped into these saved containers and
//! places, so putting them back puts back the real tensors too. Then the same walk looks for
//! fakes still reachable, and names them.
//!
//! The walk is the leak hunter's ([`crate::holders_walk`]): each object once, breadth-first from
//! the roots, with its bounds and its way of naming a path. The objects come in through
//! [`StepObjects`], a [`Heap`] whose [`Kind::Owner`]s are the containers a step may change and
//! whose [`Kind::Buffer`]s are tensors: fakes ([`FAKE`]) and real tensors that take gradients
//! ([`TAKES_GRAD`]), which the step must not use unless a module holds them as parameters; the
//! bindings implement it over Python, the tests over a fake graph.
//!
//! A real step (`verify`'s) is saved by value instead ([`save_by_value`]): the same walk, with
//! every real tensor a [`VALUE`] buffer whose value (and gradient) is copied, and each piece
//! named, so that what could not be put back is named with its value before.
//!
//! [`Kind::Owner`]: crate::holders_walk::Kind::Owner
//! [`Kind::Buffer`]: crate::holders_walk::Kind::Buffer

use std::collections::{HashMap, HashSet};

use crate::holders_walk::{self, walk, Bounds, Buffer, Heap, Root, RootKind, Survey};

/// Enough for a large model's modules and the step's own objects; a walk that stops says so.
pub const BOUNDS: Bounds = Bounds { objects: 200_000, depth: holders_walk::BOUNDS.depth };
/// Longer containers are saved and put back whole, but their items are not walked.
pub const MOST_ITEMS_WALKED: usize = 10_000;
/// Fakes left behind named in the note; the rest are counted.
const MOST_NAMED: usize = 5;
/// The kind of a [`Piece`](holders_walk::Piece) that is a fake tensor.
pub const FAKE: &str = "fake tensor";
/// The kind of a piece that is a real tensor that requires grad.
pub const TAKES_GRAD: &str = "tensor that requires grad";

/// The kind of a piece that is a real tensor whose value a by-value save copies.
pub const VALUE: &str = "tensor";

/// The random number generators a step may draw from (data augmentation does), saved in this
/// order and put back in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rng {
    TorchCpu,
    /// Every initialised CUDA device's: only where torch initialised CUDA (looking must not create
    /// a context).
    TorchCuda,
    Python,
    /// Only where NumPy is imported.
    NumPy,
}

impl Rng {
    pub const ALL: [Rng; 4] = [Rng::TorchCpu, Rng::TorchCuda, Rng::Python, Rng::NumPy];

    /// How a person names it, in a note or a `RestoreFailed`.
    pub fn label(self) -> &'static str {
        match self {
            Rng::TorchCpu => "torch's CPU RNG",
            Rng::TorchCuda => "torch's CUDA RNG",
            Rng::Python => "Python's random",
            Rng::NumPy => "NumPy's global RNG",
        }
    }
}

/// The step's objects as the saving sees them. Walked as a [`Heap`]: a container the step may
/// change (a dict, a list, a set, a deque, an object's attributes) is a `Kind::Owner`, a fake
/// tensor or a real one that requires grad a `Kind::Buffer` (of kind [`FAKE`] or [`TAKES_GRAD`]),
/// another real tensor or a plain value a `Kind::Leaf`.
pub trait StepObjects: Heap {
    /// A container, place or RNG as it was, by the identity of what it held.
    type Saved;
    type Error;
    /// The state of `rng`; None where it is not there (CUDA not initialised, NumPy not imported).
    fn save_rng(&mut self, rng: Rng) -> Result<Option<Self::Saved>, Self::Error>;
    /// Saves the places the step's roots are held in (the globals it loads, its closure cells)
    /// and the globals it assigns to (`global` names).
    fn save_places(&mut self) -> Result<Vec<Self::Saved>, Self::Error>;
    /// Whether the walk's `Owner` `object` is a model or an optimizer, whose tensors the estimate
    /// swaps for fakes (`swapped_containers`).
    fn swaps_tensors_of(&self, object: &Self::Object) -> bool;
    /// The containers whose tensors the estimate swaps for fakes in `owner` (a module's and its
    /// submodules' parameter and buffer dicts; an optimizer's attributes and param groups):
    /// saved whatever the walk's bounds, since a fake left there would break the model.
    fn swapped_containers(&mut self, owner: &Self::Object) -> Vec<Self::Object>;
    /// A copy of a container the walk reached; None where it can't be copied.
    fn save(&mut self, container: &Self::Object) -> Option<Self::Saved>;
    /// Puts a saved container back, where the step changed it; a note where it could not be.
    fn restore(&mut self, saved: &Self::Saved) -> Result<Option<String>, Self::Error>;
    /// The globals the step assigns to, bound as they are now.
    fn assigned_now(&mut self) -> Result<Vec<(String, Self::Object)>, Self::Error>;
    /// The value of the real tensor at `buffer` (a [`VALUE`] piece of a by-value walk), then its
    /// gradient where it is a leaf that takes one, each with its name (`path`, `path.grad`);
    /// nothing where it has no value to copy (a meta or sparse tensor).
    fn save_value(&mut self, buffer: Buffer, path: &str) -> Result<Vec<(String, Self::Saved)>, Self::Error>;
    /// Whether `object` is a GradScaler.
    fn is_scaler(&self, object: &Self::Object) -> bool;
    /// Makes a GradScaler step its optimizer without reading its inf check (`.item()` has no
    /// value under fake tensors): the step whose gradients are finite, the one that needs the
    /// memory. Set on what was saved, so putting it back removes this.
    fn assume_finite_gradients(&mut self, scaler: &Self::Object) -> Result<(), Self::Error>;
}

/// What the step reaches, as it was, until [`restore`].
pub struct Saving<S, O> {
    roots: Vec<(String, O)>,
    /// The models and optimizers the walk reached, in its order: the fakes go into their
    /// tensors' places.
    pub owners: Vec<O>,
    /// The RNGs first, then the places, the owners' swapped containers, and the containers in
    /// the walk's order.
    pub saved: Vec<S>,
    partial: bool,
    /// GradScalers reached: told, for the estimate, that the gradients are finite.
    pub scalers: usize,
    /// The path to each real tensor that requires grad, by its buffer: a refusal names it.
    pub takes_grad: HashMap<Buffer, String>,
}

impl<S, O> Saving<S, O> {
    /// Where the step reaches the real tensor that requires grad at `buffer`, as the user would write it.
    pub fn path_of(&self, buffer: Buffer) -> Option<&str> {
        self.takes_grad.get(&buffer).map(String::as_str)
    }
}

fn walk_from<H: Heap>(heap: &mut H, roots: &[(String, H::Object)]) -> Survey<H::Object> {
    let roots =
        roots.iter().map(|(label, object)| Root { kind: RootKind::Name, label: label.clone(), object: object.clone() });
    walk(heap, roots.collect(), None, &HashSet::new(), BOUNDS)
}

/// Saves only the RNGs: what a real step's by-value save (`verify`'s) takes from this mechanism.
pub fn save_rngs<W: StepObjects>(world: &mut W) -> Result<Vec<(Rng, W::Saved)>, W::Error> {
    let mut saved = Vec::new();
    for rng in Rng::ALL {
        if let Some(state) = world.save_rng(rng)? {
            saved.push((rng, state));
        }
    }
    Ok(saved)
}

/// Saves the RNGs, the places, and, from one walk of what `roots` and the globals the step
/// assigns reach, the containers of the models and optimizers reached that the fakes go into,
/// then every container reached; then tells each GradScaler reached that the gradients are
/// finite. The models and optimizers are in the saving's `owners`.
pub fn save<W: StepObjects>(
    world: &mut W,
    mut roots: Vec<(String, W::Object)>,
) -> Result<Saving<W::Saved, W::Object>, W::Error> {
    let mut saved: Vec<W::Saved> = save_rngs(world)?.into_iter().map(|(_, state)| state).collect();
    saved.extend(world.save_places()?);
    // A global the step assigns is walked from what it holds now, by its name.
    roots.extend(world.assigned_now()?);
    let survey = walk_from(world, &roots);
    let owners: Vec<W::Object> = survey.owners.iter().filter(|owner| world.swaps_tensors_of(owner)).cloned().collect();
    // Saved whatever the walk's bounds: a fake left in one would break the model.
    let mut pinned = HashSet::new();
    for owner in &owners {
        for container in world.swapped_containers(owner) {
            if pinned.insert(world.address(&container)) {
                saved.extend(world.save(&container));
            }
        }
    }
    for container in &survey.owners {
        if !pinned.contains(&world.address(container)) {
            saved.extend(world.save(container));
        }
    }
    let takes_grad = survey
        .held
        .into_iter()
        .filter(|(_, holder)| holder.kind == TAKES_GRAD)
        .map(|(buffer, holder)| (buffer, holder.path))
        .collect();
    let scalers: Vec<_> = survey.owners.into_iter().filter(|owner| world.is_scaler(owner)).collect();
    for scaler in &scalers {
        world.assume_finite_gradients(scaler)?;
    }
    Ok(Saving { roots, owners, saved, partial: survey.truncated, scalers: scalers.len(), takes_grad })
}

/// Puts back everything saved where the step changed it, in the order saved; returns notes
/// naming the fakes still reachable (in what no copy could put back), and the walk's limit if it
/// was reached. Each is tried before the first error met is returned.
pub fn restore<W: StepObjects>(world: &mut W, saving: Saving<W::Saved, W::Object>) -> Result<Vec<String>, W::Error> {
    let mut notes = Vec::new();
    let mut failed = None;
    for saved in &saving.saved {
        match world.restore(saved) {
            Ok(note) => notes.extend(note),
            Err(error) => {
                failed.get_or_insert(error);
            }
        }
    }
    if let Some(error) = failed {
        return Err(error);
    }
    // A global the step assigned is checked where it is now.
    let mut roots = saving.roots;
    roots.extend(world.assigned_now()?);
    let survey = walk_from(world, &roots);
    let left: Vec<_> = survey.held.iter().filter(|(_, holder)| holder.kind == FAKE).collect();
    if !left.is_empty() {
        let named: Vec<&str> = left.iter().take(MOST_NAMED).map(|(_, holder)| holder.path.as_str()).collect();
        let more = left.len() - named.len();
        let more = if more > 0 { format!(" and {more} more") } else { String::new() };
        notes.push(format!(
            "the step left fake tensors where the estimate could not put the old values back: {}{more}; \
             reassign them before the next real step",
            named.join(", ")
        ));
    }
    if saving.partial || survey.truncated {
        notes.push(format!(
            "the step reaches more than {} objects: what it changed beyond them was not put back",
            BOUNDS.objects
        ));
    }
    Ok(notes)
}

/// A real step's state, saved by value ([`save_by_value`]): each piece with its name.
pub struct ByValue<S> {
    /// The containers in the walk's order, then the tensors' values and gradients, then the RNGs.
    pub saved: Vec<(String, S)>,
    /// Whether the walk stopped at its bounds: what lies beyond was not saved.
    pub partial: bool,
}

/// A piece not put back: a note from its putting back, or the error that stopped it.
pub enum Unrestored<E> {
    Note(String),
    Error(E),
}

/// Saves by value (`verify`'s save, around a step run for real) every container reachable from
/// `roots` by the identity of what it holds, the value and gradient of every real tensor in
/// them (the world's walk makes each a [`VALUE`] buffer), and the four RNGs.
pub fn save_by_value<W: StepObjects>(
    world: &mut W,
    roots: Vec<(String, W::Object)>,
) -> Result<ByValue<W::Saved>, W::Error> {
    let survey = walk_from(world, &roots);
    let mut saved = Vec::new();
    for (container, path) in survey.owners.iter().zip(&survey.owner_paths) {
        saved.extend(world.save(container).map(|state| (path.clone(), state)));
    }
    for (buffer, holder) in &survey.held {
        if holder.kind == VALUE {
            saved.extend(world.save_value(*buffer, &holder.path)?);
        }
    }
    for (rng, state) in save_rngs(world)? {
        saved.push((rng.label().to_string(), state));
    }
    Ok(ByValue { saved, partial: survey.truncated })
}

/// Puts back each piece of a by-value save in the order saved (the containers, holding their
/// old tensors again, before the values go into those tensors); each that could not be, by its
/// index in `saving.saved`. One that fails never stops the others.
pub fn restore_by_value<W: StepObjects>(
    world: &mut W,
    saving: &ByValue<W::Saved>,
) -> Vec<(usize, Unrestored<W::Error>)> {
    let mut unrestored = Vec::new();
    for (index, (_, saved)) in saving.saved.iter().enumerate() {
        match world.restore(saved) {
            Ok(None) => {}
            Ok(Some(note)) => unrestored.push((index, Unrestored::Note(note))),
            Err(error) => unrestored.push((index, Unrestored::Error(error))),
        }
    }
    unrestored
}

#[cfg(test)]
#[path = "step_state_tests.rs"]
mod tests;
