//! The one state saving of a step, over a fake graph.
use super::*;
use crate::holders_walk::{Edge, Kind, Piece, Refs, Unreadable};

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
    /// A real tensor that requires grad.
    Leaf,
    Fake,
}

#[derive(Debug, PartialEq)]
enum Saved {
    Container(usize, Object),
    Global(&'static str, Option<usize>),
    Rng(Rng, u64),
    /// A real tensor's value, saved by a by-value walk.
    Value(usize),
}

#[derive(Default)]
struct World {
    objects: Vec<Object>,
    globals: Vec<(&'static str, usize)>,
    assigned: Vec<&'static str>,
    log: Vec<String>,
    /// Containers whose putting back refuses (a `ModelOutput` whose methods raise).
    refused: Vec<usize>,
    /// Containers whose putting back raises.
    raising: Vec<usize>,
    /// Each RNG there is, with its state (a counter the step advances).
    rngs: Vec<(Rng, u64)>,
    /// Each owner's containers that the fakes go into.
    swapped: Vec<(usize, Vec<usize>)>,
    /// A by-value walk's (verify's): every real tensor is a `VALUE` piece.
    by_value: bool,
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
            Object::Fake | Object::Leaf => Kind::Buffer(Piece {
                buffer: Buffer::Storage(*object),
                bytes: 0,
                kind: if self.objects[*object] == Object::Fake { FAKE } else { TAKES_GRAD },
                shape: String::new(),
                device: String::new(),
            }),
            Object::Tensor if self.by_value => Kind::Buffer(Piece {
                buffer: Buffer::Storage(*object),
                bytes: 0,
                kind: VALUE,
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
    fn save_rng(&mut self, rng: Rng) -> Result<Option<Saved>, String> {
        self.log.push(format!("{} saved", rng.label()));
        Ok(self.rngs.iter().find(|(r, _)| *r == rng).map(|(r, state)| Saved::Rng(*r, *state)))
    }
    fn save_places(&mut self) -> Result<Vec<Saved>, String> {
        self.log.push("globals saved".into());
        Ok(self.assigned.iter().map(|name| Saved::Global(name, self.global(name))).collect())
    }
    fn swaps_tensors_of(&self, object: &usize) -> bool {
        self.swapped.iter().any(|(owner, _)| owner == object)
    }
    fn swapped_containers(&mut self, owner: &usize) -> Vec<usize> {
        self.swapped.iter().filter(|(o, _)| o == owner).flat_map(|(_, held)| held.clone()).collect()
    }
    fn save(&mut self, container: &usize) -> Option<Saved> {
        self.log.push(format!("saved {container}"));
        Some(Saved::Container(*container, self.objects[*container].clone()))
    }
    fn restore(&mut self, saved: &Saved) -> Result<Option<String>, String> {
        match saved {
            Saved::Container(at, _) if self.raising.contains(at) => return Err(format!("container {at} raised")),
            Saved::Container(at, _) if self.refused.contains(at) => {
                return Ok(Some(format!("container {at} refused")));
            }
            Saved::Container(at, before) => self.objects[*at] = before.clone(),
            Saved::Global(name, before) => self.bind(name, *before),
            Saved::Value(at) => self.log.push(format!("value of {at} put back")),
            Saved::Rng(rng, before) => {
                self.rngs.iter_mut().filter(|(r, _)| r == rng).for_each(|(_, state)| *state = *before)
            }
        }
        Ok(None)
    }
    fn assigned_now(&mut self) -> Result<Vec<(String, usize)>, String> {
        Ok(self.assigned.iter().filter_map(|name| Some((name.to_string(), self.global(name)?))).collect())
    }
    fn save_value(&mut self, buffer: Buffer, path: &str) -> Result<Vec<(String, Saved)>, String> {
        let Buffer::Storage(at) = buffer else { return Ok(Vec::new()) };
        Ok(vec![(path.to_string(), Saved::Value(at))])
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
    assert_eq!(world.log[4], "globals saved", "after the four RNGs: {:?}", world.log);
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

#[test]
fn the_rngs_there_are_saved_first_in_their_order_and_put_back() {
    let mut world = World { rngs: vec![(Rng::NumPy, 7), (Rng::TorchCpu, 3)], ..World::default() };
    let saving = save(&mut world, Vec::new()).unwrap();
    assert_eq!(&saving.saved[..2], &[Saved::Rng(Rng::TorchCpu, 3), Saved::Rng(Rng::NumPy, 7)]);
    let labels: Vec<_> = world.log[..4].to_vec();
    assert_eq!(labels, Rng::ALL.map(|rng| format!("{} saved", rng.label())));
    // The step draws from both.
    world.rngs = vec![(Rng::NumPy, 8), (Rng::TorchCpu, 9)];
    restore(&mut world, saving).unwrap();
    assert_eq!(world.rngs, vec![(Rng::NumPy, 7), (Rng::TorchCpu, 3)]);
}

#[test]
fn an_owners_swapped_containers_are_saved_beyond_the_walks_bound_and_once() {
    let mut world = World::default();
    let items = (0..BOUNDS.objects).map(|_| world.add(Object::Tensor)).collect();
    let many = world.add(Object::Plain(items));
    let weight = world.add(Object::Tensor);
    let parameters = world.dict(&[("weight", weight)]);
    let model = world.dict(&[("_parameters", parameters)]);
    world.swapped = vec![(model, vec![parameters])];
    // The model is a root, but its dict comes after what fills the walk's bound: the walk
    // never reaches it.
    let saving = save(&mut world, vec![("many".into(), many), ("model".into(), model)]).unwrap();
    assert_eq!(saving.owners, vec![model], "the walk found the model");
    let saved_dicts = saving.saved.iter().filter(|s| matches!(s, Saved::Container(at, _) if *at == parameters));
    assert_eq!(saved_dicts.count(), 1);
    let fake = world.add(Object::Fake);
    let before = world.objects[parameters].clone();
    if let Object::Dict(items) = &mut world.objects[parameters] {
        items[0].1 = fake;
    }
    restore(&mut world, saving).unwrap();
    assert_eq!(world.objects[parameters], before, "the real weight is back");
}

#[test]
fn a_walked_owners_swapped_container_is_saved_once() {
    let mut world = World::default();
    let weight = world.add(Object::Tensor);
    let parameters = world.dict(&[("weight", weight)]);
    let model = world.dict(&[("_parameters", parameters)]);
    world.swapped = vec![(model, vec![parameters])];
    let saving = save(&mut world, vec![("model".into(), model)]).unwrap();
    assert_eq!(saving.owners, vec![model]);
    let saved: Vec<_> =
        saving.saved.iter().filter_map(|s| if let Saved::Container(at, _) = s { Some(*at) } else { None }).collect();
    assert_eq!(saved, vec![parameters, model]);
}

#[test]
fn a_real_tensor_that_requires_grad_is_known_by_the_path_the_user_would_write() {
    let mut world = World::default();
    let extra = world.add(Object::Leaf);
    let head = world.dict(&[("extra", extra)]);
    let model = world.dict(&[("head", head)]);
    let saving = save(&mut world, vec![("model".into(), model)]).unwrap();
    assert_eq!(saving.path_of(Buffer::Storage(extra)), Some("model['head']['extra']"));
    assert_eq!(saving.path_of(Buffer::Storage(head)), None);
    assert!(restore(&mut world, saving).unwrap().is_empty(), "a real tensor is no fake left behind");
}

#[test]
fn a_put_back_that_raises_stops_none_of_the_others() {
    let mut world = World { rngs: vec![(Rng::Python, 1)], ..World::default() };
    let tensor = world.add(Object::Tensor);
    let broken = world.dict(&[("a", tensor)]);
    let ema = world.dict(&[("shadow", tensor)]);
    let root = world.dict(&[("broken", broken), ("ema", ema)]);
    let saving = save(&mut world, vec![("state".into(), root)]).unwrap();
    world.raising = vec![broken];
    let before = world.objects[ema].clone();
    let other = world.add(Object::Text("changed"));
    if let Object::Dict(items) = &mut world.objects[ema] {
        items[0].1 = other;
    }
    world.rngs = vec![(Rng::Python, 2)];
    assert_eq!(restore(&mut world, saving), Err(format!("container {broken} raised")));
    assert_eq!((world.objects[ema].clone(), world.rngs.clone()), (before, vec![(Rng::Python, 1)]));
}

#[test]
fn a_real_step_is_saved_by_value_each_piece_named_and_one_that_fails_stops_no_other() {
    let mut world = World { by_value: true, rngs: vec![(Rng::Python, 1)], ..World::default() };
    let tensor = world.add(Object::Tensor);
    let table = world.dict(&[("t", tensor)]);
    let config = world.dict(&[("table", table)]);
    let saving = save_by_value(&mut world, vec![("config".into(), config)]).unwrap();
    let names: Vec<&str> = saving.saved.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(names, ["config", "config['table']", "config['table']['t']", "Python's random"]);
    assert_eq!(saving.saved[2].1, Saved::Value(tensor));
    // The step advances the RNG; the table's putting back raises.
    world.rngs[0].1 = 2;
    world.raising.push(table);
    let unrestored = restore_by_value(&mut world, &saving);
    assert_eq!(unrestored.len(), 1);
    assert!(matches!(&unrestored[0], (1, Unrestored::Error(e)) if *e == format!("container {table} raised")));
    assert_eq!(world.rngs[0].1, 1);
    assert!(world.log.contains(&format!("value of {tensor} put back")), "{:?}", world.log);
}

#[test]
fn the_one_walk_finds_the_models_and_optimizers_in_its_order_wherever_they_are_held() {
    let mut world = World::default();
    let (weight, moment) = (world.add(Object::Tensor), world.add(Object::Tensor));
    let parameters = world.dict(&[("weight", weight)]);
    let model = world.dict(&[("_parameters", parameters)]);
    let state = world.dict(&[("exp_avg", moment)]);
    let optimizer = world.dict(&[("state", state)]);
    // The optimizer in a list in a config object, the model in a dict beside a plain one.
    let listed = world.add(Object::Plain(vec![optimizer]));
    let config = world.dict(&[("optimizers", listed)]);
    let metrics = world.dict(&[]);
    let held = world.dict(&[("net", model), ("metrics", metrics)]);
    world.swapped = vec![(optimizer, vec![optimizer, state]), (model, vec![parameters])];
    let saving = save(&mut world, vec![("config".into(), config), ("held".into(), held)]).unwrap();
    assert_eq!(saving.owners, vec![model, optimizer], "breadth-first: the model is nearer its root");
    let saved: Vec<_> =
        saving.saved.iter().filter_map(|s| if let Saved::Container(at, _) = s { Some(*at) } else { None }).collect();
    // Their swapped containers first, each once, then the rest of the walk's.
    assert_eq!(&saved[..3], &[parameters, optimizer, state]);
    assert!(saved.contains(&metrics) && saved.contains(&config) && saved.len() == 7, "{saved:?}");
}
