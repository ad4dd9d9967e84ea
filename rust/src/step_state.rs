//! What a step reaches besides the model's tensors and the optimizers' state: a GradScaler, an
//! LR scheduler, an EMA copy, a metric accumulator, any attribute or container it assigns to.
//! Run under fake tensors, the step would leave fakes there (and a scheduler advanced), and the
//! next real step would fail on them. So every container reachable from the step is copied,
//! shallowly, before the estimate, and put back after it where it changed; then the same walk
//! looks for fakes still reachable, and names them.
//!
//! The walk is the leak hunter's ([`crate::holders_walk`]): each object once, breadth-first from
//! the roots, with its bounds and its way of naming a path. The objects come in through
//! [`StepObjects`], a [`Heap`] whose [`Kind::Owner`]s are the containers a step may change and
//! whose [`Kind::Buffer`]s are fake tensors; the bindings implement it over Python, the tests
//! over a fake graph.
//!
//! [`Kind::Owner`]: crate::holders_walk::Kind::Owner
//! [`Kind::Buffer`]: crate::holders_walk::Kind::Buffer

use std::collections::HashSet;

use crate::holders_walk::{self, walk, Bounds, Heap, Root, RootKind, Survey};

/// Enough for a large model's modules and the step's own objects; a walk that stops says so.
pub const BOUNDS: Bounds = Bounds { objects: 200_000, depth: holders_walk::BOUNDS.depth };
/// Longer containers are saved and put back whole, but their items are not walked.
pub const MOST_ITEMS_WALKED: usize = 10_000;
/// Fakes left behind named in the note; the rest are counted.
const MOST_NAMED: usize = 5;

/// The step's objects as the saving sees them. Walked as a [`Heap`]: a container the step may
/// change (a dict, a list, a set, a deque, an object's attributes) is a `Kind::Owner`, a fake
/// tensor a `Kind::Buffer`, a real tensor or a plain value a `Kind::Leaf`.
pub trait StepObjects: Heap {
    /// A container as it was, by the identity of what it held.
    type Saved;
    type Error;
    /// Saves the globals the step assigns to (`global` names).
    fn save_assigned(&mut self) -> Result<Vec<Self::Saved>, Self::Error>;
    /// A copy of a container the walk reached; None where it can't be copied.
    fn save(&mut self, container: &Self::Object) -> Option<Self::Saved>;
    /// Puts a saved container back, where the step changed it; a note where it could not be.
    fn restore(&mut self, saved: &Self::Saved) -> Result<Option<String>, Self::Error>;
    /// The globals the step assigns to, bound as they are now.
    fn assigned_now(&mut self) -> Result<Vec<(String, Self::Object)>, Self::Error>;
    /// Whether `object` is a GradScaler.
    fn is_scaler(&self, object: &Self::Object) -> bool;
    /// Makes a GradScaler step its optimizer without reading its inf check (`.item()` has no
    /// value under fake tensors): the step whose gradients are finite, the one that needs the
    /// memory. Set on what was saved, so putting it back removes this.
    fn assume_finite_gradients(&mut self, scaler: &Self::Object) -> Result<(), Self::Error>;
}

/// The containers reachable from a step, as they were, until [`restore`].
pub struct Saving<S, O> {
    roots: Vec<(String, O)>,
    /// The globals the step assigns first, then the containers in the walk's order.
    pub saved: Vec<S>,
    partial: bool,
    /// GradScalers reached: told, for the estimate, that the gradients are finite.
    pub scalers: usize,
}

fn walk_from<H: Heap>(heap: &mut H, roots: &[(String, H::Object)]) -> Survey<H::Object> {
    let roots =
        roots.iter().map(|(label, object)| Root { kind: RootKind::Name, label: label.clone(), object: object.clone() });
    walk(heap, roots.collect(), None, &HashSet::new(), BOUNDS)
}

/// Saves every container reachable from `roots` and from the globals the step assigns; then
/// tells each GradScaler reached that the gradients are finite.
pub fn save<W: StepObjects>(
    world: &mut W,
    mut roots: Vec<(String, W::Object)>,
) -> Result<Saving<W::Saved, W::Object>, W::Error> {
    let mut saved = world.save_assigned()?;
    // A global the step assigns is walked from what it holds now, by its name.
    roots.extend(world.assigned_now()?);
    let survey = walk_from(world, &roots);
    saved.extend(survey.owners.iter().filter_map(|container| world.save(container)));
    let scalers: Vec<_> = survey.owners.into_iter().filter(|owner| world.is_scaler(owner)).collect();
    for scaler in &scalers {
        world.assume_finite_gradients(scaler)?;
    }
    Ok(Saving { roots, saved, partial: survey.truncated, scalers: scalers.len() })
}

/// Puts back every container the step changed; returns notes naming the fakes still reachable
/// (in what no copy could put back), and the walk's limit if it was reached.
pub fn restore<W: StepObjects>(world: &mut W, saving: Saving<W::Saved, W::Object>) -> Result<Vec<String>, W::Error> {
    let mut notes = Vec::new();
    for saved in &saving.saved {
        notes.extend(world.restore(saved)?);
    }
    // A global the step assigned is checked where it is now.
    let mut roots = saving.roots;
    roots.extend(world.assigned_now()?);
    let survey = walk_from(world, &roots);
    let left = &survey.held;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::holders_walk::{Buffer, Edge, Kind, Piece, Refs, Unreadable};

    /// Objects are indices into a table; a test plays the step by changing the table.
    #[derive(Clone, Debug, PartialEq)]
    enum Object {
        /// A container the step may change: a dict by (key, value).
        Dict(Vec<(usize, usize)>),
        /// A GradScaler, its attributes by (name, value).
        Scaler(Vec<(usize, usize)>),
        /// Something walked but not copied (an object kept in C).
        Plain(Vec<usize>),
        Text(&'static str),
        Tensor,
        Fake,
    }

    #[derive(Debug, PartialEq)]
    enum Saved {
        Container(usize, Object),
        Global(&'static str, Option<usize>),
    }

    #[derive(Default)]
    struct World {
        objects: Vec<Object>,
        globals: Vec<(&'static str, usize)>,
        assigned: Vec<&'static str>,
        log: Vec<String>,
        /// Containers whose putting back refuses (a `ModelOutput` whose methods raise).
        refused: Vec<usize>,
    }

    impl World {
        fn add(&mut self, object: Object) -> usize {
            self.objects.push(object);
            self.objects.len() - 1
        }
        fn dict(&mut self, items: &[(&'static str, usize)]) -> usize {
            let items = items.iter().map(|(key, value)| (self.add(Object::Text(key)), *value)).collect();
            self.add(Object::Dict(items))
        }
        fn global(&self, name: &str) -> Option<usize> {
            self.globals.iter().find(|(n, _)| *n == name).map(|(_, object)| *object)
        }
        fn bind(&mut self, name: &'static str, object: Option<usize>) {
            self.globals.retain(|(n, _)| *n != name);
            self.globals.extend(object.map(|object| (name, object)));
        }
    }

    impl Heap for World {
        type Object = usize;
        fn address(&self, object: &usize) -> usize {
            *object
        }
        fn look(&mut self, object: &usize, refs: &mut Refs<usize>) -> Result<Kind, Unreadable> {
            Ok(match &self.objects[*object] {
                Object::Dict(items) | Object::Scaler(items) => {
                    refs.extend(items.iter().map(|(key, value)| (Edge::Key(*key), *value)));
                    Kind::Owner
                }
                Object::Plain(items) => {
                    refs.extend(items.iter().enumerate().map(|(i, item)| (Edge::Index(i), *item)));
                    Kind::Plain
                }
                Object::Fake => Kind::Buffer(Piece {
                    buffer: Buffer::Storage(*object),
                    bytes: 0,
                    kind: "fake tensor",
                    shape: String::new(),
                    device: String::new(),
                }),
                Object::Text(_) | Object::Tensor => Kind::Leaf,
            })
        }
        fn text(&self, name: &usize) -> String {
            self.describe(name)
        }
        fn is_plain(&self, key: &usize) -> bool {
            matches!(self.objects[*key], Object::Text(_))
        }
        fn describe(&self, key: &usize) -> String {
            match &self.objects[*key] {
                Object::Text(text) => format!("'{text}'"),
                _ => "<object>".into(),
            }
        }
        fn call(&self, key: &usize) -> String {
            self.describe(key)
        }
    }

    impl StepObjects for World {
        type Saved = Saved;
        type Error = String;
        fn save_assigned(&mut self) -> Result<Vec<Saved>, String> {
            self.log.push("globals saved".into());
            Ok(self.assigned.iter().map(|name| Saved::Global(name, self.global(name))).collect())
        }
        fn save(&mut self, container: &usize) -> Option<Saved> {
            self.log.push(format!("saved {container}"));
            Some(Saved::Container(*container, self.objects[*container].clone()))
        }
        fn restore(&mut self, saved: &Saved) -> Result<Option<String>, String> {
            match saved {
                Saved::Container(at, _) if self.refused.contains(at) => {
                    return Ok(Some(format!("container {at} refused")));
                }
                Saved::Container(at, before) => self.objects[*at] = before.clone(),
                Saved::Global(name, before) => self.bind(name, *before),
            }
            Ok(None)
        }
        fn assigned_now(&mut self) -> Result<Vec<(String, usize)>, String> {
            Ok(self.assigned.iter().filter_map(|name| Some((name.to_string(), self.global(name)?))).collect())
        }
        fn is_scaler(&self, object: &usize) -> bool {
            matches!(self.objects[*object], Object::Scaler(_))
        }
        fn assume_finite_gradients(&mut self, scaler: &usize) -> Result<(), String> {
            self.log.push(format!("scaler {scaler} told"));
            Ok(())
        }
    }

    #[test]
    fn what_the_step_changed_is_put_back_and_nothing_is_left() {
        let mut world = World::default();
        let tensor = world.add(Object::Tensor);
        let ema = world.dict(&[("shadow", tensor)]);
        let saving = save(&mut world, vec![("ema".into(), ema)]).unwrap();
        assert_eq!(saving.saved, vec![Saved::Container(ema, world.objects[ema].clone())]);
        // The step sets the EMA's shadow to a fake.
        let fake = world.add(Object::Fake);
        let before = world.objects[ema].clone();
        if let Object::Dict(items) = &mut world.objects[ema] {
            items[0].1 = fake;
        }
        assert_eq!(restore(&mut world, saving).unwrap(), Vec::<String>::new());
        assert_eq!(world.objects[ema], before);
    }

    #[test]
    fn fakes_no_copy_puts_back_are_named_five_and_counted() {
        let mut world = World::default();
        let cache = world.add(Object::Plain(Vec::new()));
        let saving = save(&mut world, vec![("cache".into(), cache)]).unwrap();
        assert!(saving.saved.is_empty(), "what is kept in C is walked, not copied");
        let fakes: Vec<usize> = (0..7).map(|_| world.add(Object::Fake)).collect();
        world.objects[cache] = Object::Plain(fakes);
        let notes = restore(&mut world, saving).unwrap();
        assert_eq!(notes.len(), 1);
        assert!(
            notes[0].contains("cache[0], cache[1], cache[2], cache[3], cache[4] and 2 more; reassign them"),
            "{}",
            notes[0]
        );
    }

    #[test]
    fn a_global_the_step_assigns_is_saved_first_and_checked_where_it_is_now() {
        let mut world = World::default();
        let tensor = world.add(Object::Tensor);
        let best = world.dict(&[("weights", tensor)]);
        world.assigned = vec!["best", "fresh"];
        world.bind("best", Some(best));
        let saving = save(&mut world, Vec::new()).unwrap();
        assert_eq!(saving.saved[0], Saved::Global("best", Some(best)));
        assert_eq!(saving.saved[1], Saved::Global("fresh", None));
        assert_eq!(saving.saved[2], Saved::Container(best, world.objects[best].clone()), "walked from the global");
        // The step rebinds `best` and binds `fresh`, each to something holding a fake.
        let fake = world.add(Object::Fake);
        let holding = world.add(Object::Plain(vec![fake]));
        world.bind("best", Some(holding));
        world.bind("fresh", Some(holding));
        assert!(restore(&mut world, saving).unwrap().is_empty());
        assert_eq!((world.global("best"), world.global("fresh")), (Some(best), None));
    }

    #[test]
    fn scalers_are_told_once_everything_is_saved() {
        let mut world = World::default();
        let scale = world.add(Object::Tensor);
        let key = world.add(Object::Text("_scale"));
        let scaler = world.add(Object::Scaler(vec![(key, scale)]));
        let root = world.dict(&[("scaler", scaler)]);
        let saving = save(&mut world, vec![("state".into(), root)]).unwrap();
        assert_eq!(saving.scalers, 1);
        let told = world.log.iter().position(|line| line.starts_with("scaler")).unwrap();
        assert_eq!(told, world.log.len() - 1, "{:?}", world.log);
        assert_eq!(world.log[0], "globals saved");
    }

    #[test]
    fn a_container_that_refuses_is_named_and_the_rest_are_put_back() {
        let mut world = World::default();
        let tensor = world.add(Object::Tensor);
        let output = world.dict(&[("logits", tensor)]);
        let ema = world.dict(&[("shadow", tensor)]);
        let root = world.dict(&[("output", output), ("ema", ema)]);
        let saving = save(&mut world, vec![("state".into(), root)]).unwrap();
        world.refused = vec![output];
        let before = world.objects[ema].clone();
        let fake = world.add(Object::Text("changed"));
        if let Object::Dict(items) = &mut world.objects[ema] {
            items[0].1 = fake;
        }
        let notes = restore(&mut world, saving).unwrap();
        assert_eq!(notes, vec![format!("container {output} refused")]);
        assert_eq!(world.objects[ema], before, "the others are put back all the same");
    }

    #[test]
    fn a_step_that_reaches_more_than_the_bound_says_so() {
        let mut world = World::default();
        let items = (0..BOUNDS.objects).map(|_| world.add(Object::Tensor)).collect();
        let many = world.add(Object::Plain(items));
        let saving = save(&mut world, vec![("many".into(), many)]).unwrap();
        let notes = restore(&mut world, saving).unwrap();
        assert_eq!(
            notes,
            vec![format!(
                "the step reaches more than {} objects: what it changed beyond them was not put back",
                BOUNDS.objects
            )]
        );
    }
}
