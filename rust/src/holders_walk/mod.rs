//! The leak hunter's walk: from the roots where a person's objects live, through every reference
//! the world reports, to every buffer (a tensor's storage, an array), keeping the shortest path to
//! each. The rules live here: which roots come first, the order of the walk, how a path is named,
//! that each storage counts once, and that what an autograd graph saved is charged to the tensor
//! whose `grad_fn` holds it. The objects come in through [`Heap`], which the bindings implement
//! over Python and the tests over a fake graph.

use std::collections::{HashMap, HashSet, VecDeque};

use crate::report::{render_path, Holder, PartlyRead, PathEdge};

mod hunt;
mod installed;
mod roll_up;

pub use hunt::{add_torch_figures, hunt_leaks, leaked_memories, no_such_gpu, sum_roles, survey, Leaks, LEAK_MIN_BYTES};
pub use installed::{thread_order, InstalledCode};
pub use roll_up::{rolled, Container, ROLL_UP_AT};

/// Which memory to hunt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Memory {
    /// A CUDA device, by torch index.
    Cuda(u32),
    /// Host memory: CPU tensors and numpy arrays.
    Host,
    /// Every buffer, whatever its device (an experiment's inventory at its start).
    Any,
}

impl Memory {
    pub fn label(&self) -> String {
        match self {
            Memory::Cuda(index) => format!("cuda:{index}"),
            Memory::Host => "host".into(),
            Memory::Any => "any device".into(),
        }
    }
}

/// Identifies a buffer, so that views and aliases count once: a tensor's storage, an array's base.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Buffer {
    Storage(usize),
    Array(usize),
}

/// Where a path starts, in the order the walk takes them: each kind is walked to its end before
/// the next starts, so a path is named from the first kind that reaches it, not merely the
/// shortest. What the user typed comes first; what only a library or a hook holds comes last.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RootKind {
    /// The notebook's names, alphabetically.
    Name,
    /// IPython's hidden references: `Out[3]`, the last traceback.
    Hidden,
    /// A frame of a running thread (another thread's first, the hunter's own last).
    Thread,
    /// Globals of modules the user wrote (not installed packages).
    UserModule,
    /// The frame of a pending asyncio task, or of a suspended generator or coroutine.
    Suspended,
    /// Globals of installed packages and the standard library.
    LibraryModule,
    /// The interpreter's hooks that no module global holds: trace and profile functions,
    /// signal handlers.
    Hook,
}

pub struct Root<O> {
    pub kind: RootKind,
    /// How a person names it: `cache`, `Out[3]`, `thread "Thread-3 (worker)": worker(), line 4`.
    pub label: String,
    pub object: O,
}

/// A name on an edge: fixed text, or an object (an attribute's name, a local's name) read only
/// when a path through it is named.
#[derive(Clone, Debug)]
pub enum Name<O> {
    Fixed(&'static str),
    Text(String),
    Of(O),
}

/// One step from an object to something it refers to, as a person would name it.
#[derive(Clone, Debug)]
pub enum Edge<O> {
    Attr(Name<O>),
    /// A dict key: a string by its repr, an object the walk reached by the path to it.
    Key(O),
    Index(usize),
    Closure(Name<O>),
    /// A frame of a traceback or of a suspended generator: "step(), line 3".
    Frame(String),
    Local(Name<O>),
    /// A result an `lru_cache` keeps, by the key it was called with.
    CacheEntry(O),
    /// A reference the holder reports without a name for it, by the holder's type.
    Referent(String),
    /// Into an autograd graph: `grad_fn`, its saved tensors, the functions after it. Walked after
    /// everything else, so that only memory nothing else holds is charged to the graph's tensor.
    Backward(Name<O>),
}

/// A buffer in the memory hunted, as found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    pub buffer: Buffer,
    pub bytes: u64,
    /// "tensor", "ndarray".
    pub kind: &'static str,
    pub shape: String,
    pub device: String,
}

/// What an object is to the walk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Followed through the references it gave.
    Plain,
    /// Its references are roots of their own (a module, whose globals are), or lead nowhere.
    Leaf,
    /// A buffer in the memory hunted; its references (`grad`, `grad_fn`) are followed too. (To
    /// an estimate's state saving, `crate::step_state`: a fake tensor, named if one is left.)
    Buffer(Piece),
    /// A model or an optimizer: followed, and remembered, for what its tensors are to training.
    /// (To an estimate's state saving: a container the step may change, to be copied.)
    Owner,
}

/// The object could not be inspected (it raised): it is skipped and counted, never re-raised.
#[derive(Debug)]
pub struct Unreadable;

pub type Refs<O> = Vec<(Edge<O>, O)>;

/// The objects a walk goes through.
pub trait Heap {
    type Object: Clone;
    /// The object's identity while the walk holds it.
    fn address(&self, object: &Self::Object) -> usize;
    /// What `object` is; what it refers to is appended to `refs`, each with the edge that
    /// names it. Objects that refer to nothing (numbers, strings) need not be given.
    fn look(&mut self, object: &Self::Object, refs: &mut Refs<Self::Object>) -> Result<Kind, Unreadable>;
    /// A name object as text: `weight`.
    fn text(&self, name: &Self::Object) -> String;
    /// Whether a key is a plain value, text or a number: read by its repr, never by a path that
    /// reached the same object elsewhere (one small int is every name's `3`).
    fn is_plain(&self, key: &Self::Object) -> bool;
    /// A key as a person reads it where the walk has no path to it: `'exp_avg'`, `<tensor [3]>`.
    fn describe(&self, key: &Self::Object) -> String;
    /// An `lru_cache` key as the call that made it: `(268435456,)`, `(2, k=3)`.
    fn call(&self, key: &Self::Object) -> String;
    /// Asked after each `look`: where that object is a container whose elements it read one by
    /// one (a NumPy object array, a pandas column) and it holds more than [`ELEMENTS_READ`], so
    /// that `look` gave only the first of them, how many it holds.
    fn elements_left_unread(&mut self) -> Option<u64> {
        None
    }
    /// A container's type as a person names it: `list`, `dict`.
    fn type_name(&self, _container: &Self::Object) -> String {
        "container".into()
    }
}

/// The elements of one container that the walk reads one by one at most, first to last: a
/// NumPy object array or a pandas column gives the collector no referents, and a column of
/// millions of rows would cost the hunt seconds. The report names what it read only in part.
pub const ELEMENTS_READ: usize = 100_000;

/// How far a walk goes: a kernel with millions of objects, or a linked list a million long,
/// ends the walk with a note instead of hanging the kernel.
#[derive(Clone, Copy, Debug)]
pub struct Bounds {
    pub objects: usize,
    pub depth: u32,
}

pub const BOUNDS: Bounds = Bounds { objects: 5_000_000, depth: 10_000 };

/// What a walk found.
pub struct Survey<O> {
    /// Every buffer found outside `exclude` with the path to what holds it, largest first
    /// (counting what its autograd graph saved).
    pub held: Vec<(Buffer, Holder)>,
    /// The containers with at least [`ROLL_UP_AT`] elements in `held`, shown as one row each.
    pub containers: Vec<Container>,
    /// Every buffer reached, through a path or an autograd graph, exclusions included.
    pub found: HashMap<Buffer, u64>,
    /// Every live buffer of the memory hunted that the collector knows, reachable or not
    /// (empty where the walk was not given them: [`survey`] gives them).
    pub live: HashMap<Buffer, u64>,
    /// The `Owner`s reached on the way, in the walk's order: models and optimizers.
    pub owners: Vec<O>,
    /// The path to each of `owners`, in its order: a failure to put one back names it.
    pub owner_paths: Vec<String>,
    pub objects_visited: u64,
    /// Objects that raised when inspected, each counted once per notebook name bound to it:
    /// `weakref.proxy` hands out one proxy for one referent, and three names bound to it are
    /// three entries the user sees skipped, not one.
    pub skipped: u64,
    /// Whether a bound stopped the walk before it saw everything.
    pub truncated: bool,
    /// The containers it read only the first [`ELEMENTS_READ`] elements of.
    pub partly_read: Vec<PartlyRead>,
}

enum Step<O> {
    Root(String),
    Edge(Edge<O>),
}

struct Node<O> {
    object: O,
    parent: Option<usize>,
    step: Step<O>,
    /// The tensor whose autograd graph this node belongs to.
    graph_of: Option<usize>,
    depth: u32,
    /// The notebook's names bound to this object besides the first path's: counted with it
    /// if it cannot be inspected.
    other_names: u32,
}

struct Found {
    node: usize,
    piece: Piece,
    /// The tensor an autograd graph's saved memory is charged to.
    charged_to: Option<usize>,
}

struct Walk<'h, H: Heap> {
    heap: &'h mut H,
    bounds: Bounds,
    nodes: Vec<Node<H::Object>>,
    /// Object address → its node: each object is reached once, by the first path to it.
    visited: HashMap<usize, usize>,
    queue: VecDeque<usize>,
    /// Edges into autograd graphs, followed once everything else is walked.
    graphs: Vec<(usize, Edge<H::Object>, H::Object)>,
    found: HashMap<Buffer, Found>,
    /// Buffer nodes that own a graph: what their holder line says when their own storage is
    /// not theirs to name (a view, or excluded).
    pieces: HashMap<usize, Piece>,
    owners: Vec<H::Object>,
    owner_nodes: Vec<usize>,
    skipped: u64,
    truncated: bool,
    /// Nodes read in part, with how many elements each holds.
    partly_read: Vec<(usize, u64)>,
    /// Wanted buffers not found yet: the walk may stop once none is left.
    missing: Option<HashSet<Buffer>>,
}

/// Walks from `roots` (each kind in [`RootKind`]'s order, then the autograd graphs) to every
/// buffer. With `until`, the walk of roots stops once each of those buffers is found. `exclude`
/// are buffers that existed before (an experiment's start): never named, never charged.
pub fn walk<H: Heap>(
    heap: &mut H,
    mut roots: Vec<Root<H::Object>>,
    until: Option<&HashSet<Buffer>>,
    exclude: &HashSet<Buffer>,
    bounds: Bounds,
) -> Survey<H::Object> {
    roots.sort_by_key(|root| root.kind);
    let mut walk = Walk {
        heap,
        bounds,
        nodes: Vec::new(),
        visited: HashMap::new(),
        queue: VecDeque::new(),
        graphs: Vec::new(),
        found: HashMap::new(),
        pieces: HashMap::new(),
        owners: Vec::new(),
        owner_nodes: Vec::new(),
        skipped: 0,
        truncated: false,
        partly_read: Vec::new(),
        missing: until.cloned(),
    };
    let mut roots = roots.into_iter().peekable();
    while let Some(kind) = roots.peek().map(|root| root.kind) {
        while let Some(root) = roots.next_if(|root| root.kind == kind) {
            if kind == RootKind::Name {
                walk.count_name(&root.object);
            }
            walk.push(root.object, None, Step::Root(root.label));
        }
        walk.run(true);
        if walk.all_found() {
            break;
        }
    }
    // Whatever stopped the roots' walk, the graphs are walked: their memory has no other path.
    for (parent, edge, object) in std::mem::take(&mut walk.graphs) {
        walk.push(object, Some(parent), Step::Edge(edge));
    }
    walk.run(false);
    walk.finish(exclude)
}

impl<H: Heap> Walk<'_, H> {
    fn all_found(&self) -> bool {
        self.missing.as_ref().is_some_and(HashSet::is_empty)
    }

    /// Names are the first roots, pushed before anything is looked at: a name bound to an
    /// object already reached is counted on that object's node.
    fn count_name(&mut self, object: &H::Object) {
        if let Some(&node) = self.visited.get(&self.heap.address(object)) {
            self.nodes[node].other_names += 1;
        }
    }

    fn push(&mut self, object: H::Object, parent: Option<usize>, step: Step<H::Object>) {
        let address = self.heap.address(&object);
        if self.visited.contains_key(&address) {
            return;
        }
        let (depth, graph_of) = match parent {
            None => (0, None),
            Some(parent) => {
                let into_graph = matches!(step, Step::Edge(Edge::Backward(_)));
                let graph_of = self.nodes[parent].graph_of.or(into_graph.then_some(parent));
                (self.nodes[parent].depth + 1, graph_of)
            }
        };
        if depth > self.bounds.depth || self.nodes.len() >= self.bounds.objects {
            self.truncated = true;
            return;
        }
        self.visited.insert(address, self.nodes.len());
        self.nodes.push(Node { object, parent, step, graph_of, depth, other_names: 0 });
        self.queue.push_back(self.nodes.len() - 1);
    }

    fn run(&mut self, stop_when_found: bool) {
        let mut refs = Vec::new();
        while let Some(index) = self.queue.pop_front() {
            if stop_when_found && self.all_found() {
                self.queue.clear();
                return;
            }
            let object = self.nodes[index].object.clone();
            refs.clear();
            let kind = match self.heap.look(&object, &mut refs) {
                Ok(kind) => kind,
                Err(Unreadable) => {
                    self.skipped += 1 + u64::from(self.nodes[index].other_names);
                    continue;
                }
            };
            if let Some(elements) = self.heap.elements_left_unread() {
                self.partly_read.push((index, elements));
            }
            match kind {
                Kind::Leaf => continue,
                Kind::Plain => {}
                Kind::Owner => {
                    self.owners.push(object);
                    self.owner_nodes.push(index);
                }
                Kind::Buffer(piece) => self.record(index, piece, &refs),
            }
            let in_graph = self.nodes[index].graph_of.is_some();
            for (edge, child) in refs.drain(..) {
                if matches!(edge, Edge::Backward(_)) && !in_graph {
                    self.graphs.push((index, edge, child));
                } else {
                    self.push(child, Some(index), Step::Edge(edge));
                }
            }
        }
    }

    fn record(&mut self, node: usize, piece: Piece, refs: &Refs<H::Object>) {
        if refs.iter().any(|(edge, _)| matches!(edge, Edge::Backward(_))) && self.nodes[node].graph_of.is_none() {
            self.pieces.insert(node, piece.clone());
        }
        if let Some(missing) = self.missing.as_mut() {
            missing.remove(&piece.buffer);
        }
        let charged_to = self.nodes[node].graph_of;
        self.found.entry(piece.buffer).or_insert(Found { node, piece, charged_to });
    }

    fn finish(self, exclude: &HashSet<Buffer>) -> Survey<H::Object> {
        // What each graph's tensor is charged, and on which device the charged memory sits.
        let mut saved: HashMap<usize, (u64, &str)> = HashMap::new();
        for found in self.found.values() {
            if let Some(owner) = found.charged_to.filter(|_| !exclude.contains(&found.piece.buffer)) {
                saved.entry(owner).or_insert((0, &found.piece.device)).0 += found.piece.bytes;
            }
        }
        let mut held: Vec<(Buffer, Holder, usize)> = Vec::new();
        for found in self.found.values().filter(|f| f.charged_to.is_none() && !exclude.contains(&f.piece.buffer)) {
            let saved = saved.remove(&found.node).map_or(0, |(bytes, _)| bytes);
            held.push((
                found.piece.buffer,
                self.holder(found.node, &found.piece, found.piece.bytes, saved),
                found.node,
            ));
        }
        // A tensor whose own storage is not its to name (a view, older, on another device), or a
        // `grad_fn` held by itself, still holds its graph.
        for (owner, (bytes, device)) in saved {
            let graph = Piece {
                buffer: Buffer::Storage(0),
                bytes: 0,
                kind: "autograd graph",
                shape: String::new(),
                device: device.to_string(),
            };
            let piece = self.pieces.get(&owner).filter(|p| p.device == device).unwrap_or(&graph);
            held.push((piece.buffer, self.holder(owner, piece, 0, bytes), owner));
        }
        held.sort_by(|(_, a, _), (_, b, _)| {
            (b.bytes + b.saved_for_backward).cmp(&(a.bytes + a.saved_for_backward)).then_with(|| a.path.cmp(&b.path))
        });
        let read = ELEMENTS_READ as u64;
        let partly_read =
            self.partly_read.iter().map(|&(node, elements)| PartlyRead { path: self.path(node, 0), elements, read });
        let partly_read = partly_read.collect();
        let containers = self.containers(held.iter().map(|(_, _, node)| *node));
        Survey {
            held: held.into_iter().map(|(buffer, holder, _)| (buffer, holder)).collect(),
            containers,
            found: self.found.iter().map(|(buffer, found)| (*buffer, found.piece.bytes)).collect(),
            live: HashMap::new(),
            owner_paths: self.owner_nodes.iter().map(|&node| self.path(node, 0)).collect(),
            owners: self.owners,
            objects_visited: self.nodes.len() as u64,
            skipped: self.skipped,
            truncated: self.truncated,
            partly_read,
        }
    }

    /// The lists, tuples and dicts that hold at least `ROLL_UP_AT` of the holders at `nodes`
    /// (in `held`'s order) as their elements.
    fn containers(&self, nodes: impl Iterator<Item = usize>) -> Vec<Container> {
        let mut members: Vec<(usize, Vec<usize>)> = Vec::new();
        for (index, node) in nodes.enumerate() {
            let element = matches!(self.nodes[node].step, Step::Edge(Edge::Index(_) | Edge::Key(_)));
            let Some(parent) = self.nodes[node].parent.filter(|_| element) else { continue };
            match members.iter_mut().find(|(p, _)| *p == parent) {
                Some((_, of)) => of.push(index),
                None => members.push((parent, vec![index])),
            }
        }
        (members.into_iter().filter(|(_, of)| of.len() >= ROLL_UP_AT))
            .map(|(parent, members)| Container {
                path: self.path(parent, 0),
                type_name: self.heap.type_name(&self.nodes[parent].object),
                members,
            })
            .collect()
    }

    fn holder(&self, node: usize, piece: &Piece, bytes: u64, saved: u64) -> Holder {
        Holder {
            path: self.path(node, 0),
            bytes,
            saved_for_backward: saved,
            device: piece.device.clone(),
            kind: piece.kind.into(),
            shape: piece.shape.clone(),
        }
    }

    /// The path to a node; `nesting` counts dict keys named by their own paths, which stop
    /// after two levels (a key reached through a dict keyed by itself would never end).
    fn path(&self, mut node: usize, nesting: u32) -> String {
        let mut edges = Vec::new();
        loop {
            let current = &self.nodes[node];
            edges.push(match &current.step {
                Step::Root(label) => PathEdge::Root(label.clone()),
                Step::Edge(edge) => self.path_edge(edge, node, nesting),
            });
            match current.parent {
                Some(parent) => node = parent,
                None => break,
            }
        }
        edges.reverse();
        render_path(&edges)
    }

    fn path_edge(&self, edge: &Edge<H::Object>, node: usize, nesting: u32) -> PathEdge {
        let name = |name: &Name<H::Object>| match name {
            Name::Fixed(text) => text.to_string(),
            Name::Text(text) => text.clone(),
            Name::Of(object) => self.heap.text(object),
        };
        match edge {
            Edge::Attr(n) | Edge::Backward(n) => PathEdge::Attr(name(n)),
            Edge::Key(key) => PathEdge::Key(self.key(key, node, nesting)),
            Edge::Index(i) => PathEdge::Index(*i),
            Edge::Closure(n) => PathEdge::Closure(name(n)),
            Edge::Frame(label) => PathEdge::Frame(label.clone()),
            Edge::Local(n) => PathEdge::Local(name(n)),
            Edge::CacheEntry(key) => PathEdge::CacheEntry(self.heap.call(key)),
            Edge::Referent(holder) => PathEdge::Referent(holder.clone()),
        }
    }

    /// A dict key: a plain value by its repr; an object the walk reached otherwise by the path to it
    /// (an optimizer's state is keyed by parameters: `opt.state[model.0.weight]`).
    fn key(&self, key: &H::Object, keyed: usize, nesting: u32) -> String {
        if self.heap.is_plain(key) {
            return self.heap.describe(key);
        }
        match self.visited.get(&self.heap.address(key)) {
            Some(&known) if known != keyed && nesting < 2 => self.path(known, nesting + 1),
            _ => self.heap.describe(key),
        }
    }
}

#[cfg(test)]
mod tests;
