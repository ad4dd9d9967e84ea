//! The walk's rules on a fake object graph: objects are indices into a table.

use super::*;

const MIB: u64 = 1 << 20;

#[derive(Clone)]
enum Fake {
    /// A tensor: its storage and bytes, and its references (grad, grad_fn).
    Tensor(usize, u64, Vec<(Edge<usize>, usize)>),
    Plain(Vec<(Edge<usize>, usize)>),
    /// A container of this many elements, which gives only the first `ELEMENTS_READ` of them.
    Large(Vec<(Edge<usize>, usize)>, u64),
    Owner(Vec<(Edge<usize>, usize)>),
    Leaf,
    Text(&'static str),
    Raises,
}

#[derive(Default)]
struct Graph {
    objects: Vec<Fake>,
    looked: usize,
    /// What the last `look` left unread.
    unread: Option<u64>,
}

impl Graph {
    fn add(&mut self, object: Fake) -> usize {
        self.objects.push(object);
        self.objects.len() - 1
    }
    fn tensor(&mut self, storage: usize, bytes: u64) -> usize {
        self.add(Fake::Tensor(storage, bytes, Vec::new()))
    }
    fn word(&mut self, text: &'static str) -> usize {
        self.add(Fake::Text(text))
    }
    fn refer(&mut self, from: usize, edge: Edge<usize>, to: usize) {
        match &mut self.objects[from] {
            Fake::Tensor(_, _, refs) | Fake::Plain(refs) | Fake::Large(refs, _) | Fake::Owner(refs) => {
                refs.push((edge, to))
            }
            _ => panic!("object {from} refers to nothing"),
        }
    }
    fn list(&mut self, items: &[usize]) -> usize {
        let list = self.add(Fake::Plain(Vec::new()));
        for (i, item) in items.iter().enumerate() {
            self.refer(list, Edge::Index(i), *item);
        }
        list
    }
}

impl Heap for Graph {
    type Object = usize;
    fn address(&self, object: &usize) -> usize {
        *object
    }
    fn look(&mut self, object: &usize, refs: &mut Refs<usize>) -> Result<Kind, Unreadable> {
        self.looked += 1;
        self.unread = None;
        Ok(match &self.objects[*object] {
            Fake::Tensor(storage, bytes, children) => {
                refs.extend(children.iter().cloned());
                Kind::Buffer(Piece {
                    buffer: Buffer::Storage(*storage),
                    bytes: *bytes,
                    kind: "tensor",
                    shape: "[1]".into(),
                    device: "cuda:0".into(),
                })
            }
            Fake::Plain(children) => {
                refs.extend(children.iter().cloned());
                Kind::Plain
            }
            Fake::Owner(children) => {
                refs.extend(children.iter().cloned());
                Kind::Owner
            }
            Fake::Large(children, elements) => {
                refs.extend(children.iter().take(ELEMENTS_READ).cloned());
                self.unread = Some(*elements).filter(|n| *n > ELEMENTS_READ as u64);
                Kind::Plain
            }
            Fake::Leaf | Fake::Text(_) => Kind::Leaf,
            Fake::Raises => return Err(Unreadable),
        })
    }
    fn text(&self, name: &usize) -> String {
        match &self.objects[*name] {
            Fake::Text(text) => text.to_string(),
            _ => format!("<object {name}>"),
        }
    }
    fn is_plain(&self, key: &usize) -> bool {
        matches!(self.objects[*key], Fake::Text(_))
    }
    fn describe(&self, key: &usize) -> String {
        match &self.objects[*key] {
            Fake::Text(text) => format!("'{text}'"),
            _ => format!("<object {key}>"),
        }
    }
    fn call(&self, key: &usize) -> String {
        format!("({},)", self.text(key))
    }
    fn elements_left_unread(&mut self) -> Option<u64> {
        self.unread.take()
    }
    fn type_name(&self, _container: &usize) -> String {
        "list".into()
    }
}

fn root(kind: RootKind, label: &str, object: usize) -> Root<usize> {
    Root { kind, label: label.into(), object }
}

fn hunt(graph: &mut Graph, roots: Vec<Root<usize>>) -> Survey<usize> {
    walk(graph, roots, None, &HashSet::new(), BOUNDS)
}

fn paths(survey: &Survey<usize>) -> Vec<(String, u64, u64)> {
    survey.held.iter().map(|(_, h)| (h.path.clone(), h.bytes, h.saved_for_backward)).collect()
}

#[test]
fn a_user_name_names_a_path_before_a_shorter_one_from_a_module() {
    let mut g = Graph::default();
    let t = g.tensor(1, 64 * MIB);
    let inner = g.list(&[t]);
    let outer = g.list(&[inner]);
    let survey =
        hunt(&mut g, vec![root(RootKind::LibraryModule, "somelib.CACHE", t), root(RootKind::Name, "runs", outer)]);
    assert_eq!(paths(&survey), vec![("runs[0][0]".into(), 64 * MIB, 0)]);
}

#[test]
fn root_kinds_go_in_their_order_whatever_order_they_come_in() {
    let mut kinds = [
        RootKind::Hook,
        RootKind::LibraryModule,
        RootKind::Suspended,
        RootKind::UserModule,
        RootKind::Thread,
        RootKind::Hidden,
        RootKind::Name,
    ];
    kinds.sort();
    assert_eq!(kinds.first(), Some(&RootKind::Name));
    assert_eq!(kinds.last(), Some(&RootKind::Hook));
    let mut g = Graph::default();
    let t = g.tensor(1, MIB);
    let survey = hunt(
        &mut g,
        vec![root(RootKind::Hook, "signal handler SIGTERM", t), root(RootKind::Thread, "thread \"w\"", t)],
    );
    assert_eq!(paths(&survey)[0].0, "thread \"w\"");
}

#[test]
fn cycles_end_and_each_object_is_looked_at_once() {
    let mut g = Graph::default();
    let t = g.tensor(1, MIB);
    let a = g.add(Fake::Plain(Vec::new()));
    let b = g.add(Fake::Plain(Vec::new()));
    let next = g.word("next");
    g.refer(a, Edge::Attr(Name::Of(next)), b);
    g.refer(b, Edge::Attr(Name::Fixed("back")), a);
    g.refer(b, Edge::Attr(Name::Fixed("t")), t);
    let survey = hunt(&mut g, vec![root(RootKind::Name, "a", a), root(RootKind::Name, "b", b)]);
    assert_eq!(paths(&survey), vec![("b.t".into(), MIB, 0)]);
    assert_eq!((survey.objects_visited, g.looked), (3, 3));
}

#[test]
fn a_storage_shared_by_views_counts_once_by_its_first_path() {
    let mut g = Graph::default();
    let base = g.tensor(7, 16 * MIB);
    let view = g.tensor(7, 16 * MIB);
    let other = g.tensor(8, 2 * MIB);
    let survey = hunt(
        &mut g,
        vec![root(RootKind::Name, "base", base), root(RootKind::Name, "view", view), root(RootKind::Name, "x", other)],
    );
    assert_eq!(paths(&survey), vec![("base".into(), 16 * MIB, 0), ("x".into(), 2 * MIB, 0)]);
    assert_eq!(survey.found.len(), 2);
}

#[test]
fn an_lru_cache_entry_and_a_thread_local_are_named_as_a_person_says_them() {
    let mut g = Graph::default();
    let cached = g.tensor(1, 1 << 30);
    let arg = g.word("268435456");
    let table = g.add(Fake::Plain(vec![(Edge::CacheEntry(arg), cached)]));
    let local = g.tensor(2, 512 * MIB);
    let buf = g.word("buf");
    let frame = g.add(Fake::Plain(vec![(Edge::Local(Name::Of(buf)), local)]));
    let survey = hunt(
        &mut g,
        vec![
            root(RootKind::Name, "table", table),
            root(RootKind::Thread, "thread \"Thread-3 (worker)\": worker(), line 4", frame),
        ],
    );
    assert_eq!(
        paths(&survey),
        vec![
            ("table (lru_cache entry for (268435456,))".into(), 1 << 30, 0),
            ("thread \"Thread-3 (worker)\": worker(), line 4: buf".into(), 512 * MIB, 0),
        ]
    );
}

/// `preds[i]` with a graph whose function saved `saved` (`shared` in both graphs), and an
/// AccumulateGrad reaching `weight`, which a model holds too.
struct Training {
    graph: Graph,
    preds: usize,
    model: usize,
}

fn training() -> Training {
    let mut g = Graph::default();
    let weight = g.tensor(100, 4 * MIB);
    let model = g.add(Fake::Owner(vec![(Edge::Attr(Name::Fixed("weight")), weight)]));
    let accumulate = g.add(Fake::Plain(vec![(Edge::Backward(Name::Fixed("variable")), weight)]));
    let shared = g.tensor(300, 16 * MIB);
    let mut preds = Vec::new();
    for i in 0..2 {
        let saved = g.tensor(200 + i, 128 * MIB);
        let saved_copy = g.tensor(200 + i, 128 * MIB); // a second Python object on the same storage
        let next = g.list(&[accumulate]);
        let grad_fn = g.add(Fake::Plain(vec![
            (Edge::Backward(Name::Fixed("_saved_self")), saved),
            (Edge::Backward(Name::Fixed("_saved_other")), saved_copy),
            (Edge::Backward(Name::Fixed("_saved_mat2")), shared),
            (Edge::Backward(Name::Fixed("next_functions")), next),
        ]));
        let pred = g.tensor(10 + i, 8 * MIB);
        g.refer(pred, Edge::Backward(Name::Fixed("grad_fn")), grad_fn);
        preds.push(pred);
    }
    let preds = g.list(&preds);
    Training { graph: g, preds, model }
}

#[test]
fn what_a_graph_saved_is_charged_to_its_tensor_once_and_only_if_nothing_else_holds_it() {
    let Training { mut graph, preds, model } = training();
    // `preds` comes first, and its graph reaches the weight before `model`'s path does.
    let survey = hunt(&mut graph, vec![root(RootKind::Name, "model", model), root(RootKind::Name, "preds", preds)]);
    assert_eq!(
        paths(&survey),
        vec![
            ("preds[0]".into(), 8 * MIB, 144 * MIB),
            ("preds[1]".into(), 8 * MIB, 128 * MIB),
            ("model.weight".into(), 4 * MIB, 0),
        ]
    );
    assert_eq!(survey.owners, vec![model]);
    assert_eq!(survey.found.len(), 6, "every storage is found, charged or named");
}

#[test]
fn a_graph_is_walked_even_when_the_wanted_buffers_were_all_found() {
    let Training { mut graph, preds, model } = training();
    let wanted: HashSet<Buffer> = [Buffer::Storage(10), Buffer::Storage(11)].into();
    let roots = vec![root(RootKind::Name, "preds", preds), root(RootKind::LibraryModule, "lib.model", model)];
    let survey = walk(&mut graph, roots, Some(&wanted), &HashSet::new(), BOUNDS);
    // The module was never walked, so the graph reached the weight first and it counts as saved.
    assert_eq!(paths(&survey)[0], ("preds[0]".into(), 8 * MIB, 148 * MIB));
}

#[test]
fn buffers_that_existed_before_are_neither_named_nor_charged() {
    let Training { mut graph, preds, model } = training();
    let before: HashSet<Buffer> = [Buffer::Storage(10), Buffer::Storage(300), Buffer::Storage(100)].into();
    let roots = vec![root(RootKind::Name, "model", model), root(RootKind::Name, "preds", preds)];
    let survey = walk(&mut graph, roots, None, &before, BOUNDS);
    // preds[0] is older, but what its graph saved since is still its to name.
    assert_eq!(paths(&survey), vec![("preds[1]".into(), 8 * MIB, 128 * MIB), ("preds[0]".into(), 0, 128 * MIB)]);
}

#[test]
fn the_walk_stops_once_every_wanted_buffer_is_found() {
    let mut g = Graph::default();
    let t = g.tensor(1, MIB);
    let junk: Vec<usize> = (0..100).map(|_| g.add(Fake::Leaf)).collect();
    let junk = g.list(&junk);
    let wanted: HashSet<Buffer> = [Buffer::Storage(1)].into();
    let roots = vec![root(RootKind::Name, "t", t), root(RootKind::LibraryModule, "lib.junk", junk)];
    let survey = walk(&mut g, roots, Some(&wanted), &HashSet::new(), BOUNDS);
    assert_eq!(paths(&survey), vec![("t".into(), MIB, 0)]);
    assert_eq!(survey.objects_visited, 1);
}

#[test]
fn dict_keys_read_as_text_or_as_the_path_to_the_object() {
    let mut g = Graph::default();
    let weight = g.tensor(1, 4 * MIB);
    let model = g.add(Fake::Owner(vec![(Edge::Attr(Name::Fixed("weight")), weight)]));
    let exp_avg = g.tensor(2, 4 * MIB);
    let name = g.word("exp_avg");
    let slot = g.add(Fake::Plain(vec![(Edge::Key(name), exp_avg)]));
    let state = g.add(Fake::Plain(vec![(Edge::Key(weight), slot)]));
    let unknown_key = g.add(Fake::Leaf);
    let lost = g.tensor(3, 2 * MIB);
    let other = g.add(Fake::Plain(vec![(Edge::Key(unknown_key), lost)]));
    let roots = vec![
        root(RootKind::Name, "model", model),
        root(RootKind::Name, "opt", state),
        root(RootKind::Name, "d", other),
    ];
    let found = paths(&hunt(&mut g, roots));
    assert!(found.contains(&("opt[model.weight]['exp_avg']".into(), 4 * MIB, 0)), "{found:?}");
    assert!(found.contains(&(format!("d[<object {unknown_key}>]"), 2 * MIB, 0)), "{found:?}");
}

#[test]
fn a_key_reached_only_through_its_own_entry_is_described_not_recursed() {
    let mut g = Graph::default();
    let t = g.tensor(1, MIB);
    let d = g.add(Fake::Plain(Vec::new()));
    g.refer(d, Edge::Key(t), t);
    let found = paths(&hunt(&mut g, vec![root(RootKind::Name, "d", d)]));
    assert_eq!(found, vec![(format!("d[<object {t}>]"), MIB, 0)]);
}

#[test]
fn an_object_that_raises_is_skipped_and_counted_and_the_walk_goes_on() {
    let mut g = Graph::default();
    let bad = g.add(Fake::Raises);
    let t = g.tensor(1, MIB);
    let both = g.list(&[bad, t]);
    let survey = hunt(&mut g, vec![root(RootKind::Name, "both", both)]);
    assert_eq!((paths(&survey), survey.skipped), (vec![("both[1]".into(), MIB, 0)], 1));
}

#[test]
fn an_object_that_raises_is_counted_once_per_name_bound_to_it() {
    let mut g = Graph::default();
    let proxy = g.add(Fake::Raises);
    let held = g.list(&[proxy, proxy]);
    let names = ["p1", "p2", "p3"].map(|name| root(RootKind::Name, name, proxy));
    let mut roots = names.into_iter().collect::<Vec<_>>();
    roots.push(root(RootKind::Name, "held", held));
    roots.push(root(RootKind::UserModule, "__main__.p1", proxy));
    let survey = hunt(&mut g, roots);
    assert_eq!(survey.skipped, 3, "three names, one object; a list or a module reaching it again adds none");
}

#[test]
fn bounds_on_depth_and_objects_end_the_walk_with_a_flag() {
    let mut g = Graph::default();
    let t = g.tensor(1, MIB);
    let mut chain = t;
    for _ in 0..50 {
        chain = g.list(&[chain]);
    }
    let deep = walk(
        &mut g,
        vec![root(RootKind::Name, "chain", chain)],
        None,
        &HashSet::new(),
        Bounds { objects: 1000, depth: 10 },
    );
    assert!(deep.held.is_empty() && deep.truncated);
    let many = walk(
        &mut g,
        vec![root(RootKind::Name, "chain", chain)],
        None,
        &HashSet::new(),
        Bounds { objects: 20, depth: 1000 },
    );
    assert!(many.held.is_empty() && many.truncated && many.objects_visited == 20);
    let all = hunt(&mut g, vec![root(RootKind::Name, "chain", chain)]);
    assert!(!all.truncated && all.held.len() == 1 && all.held[0].1.path.ends_with("[0][0]"));
}

#[test]
fn a_graph_held_by_a_tensor_elsewhere_or_by_its_grad_fn_alone_is_still_charged() {
    let mut g = Graph::default();
    let saved = g.tensor(1, 64 * MIB);
    let grad_fn = g.add(Fake::Plain(vec![(Edge::Backward(Name::Fixed("_saved_self")), saved)]));
    // A tensor the hunt does not count (on the host, say), whose graph saved memory it does.
    let elsewhere = g.add(Fake::Plain(vec![(Edge::Backward(Name::Fixed("grad_fn")), grad_fn)]));
    let survey = hunt(&mut g, vec![root(RootKind::Name, "loss_on_cpu", elsewhere)]);
    let (_, holder) = &survey.held[0];
    assert_eq!((holder.path.as_str(), holder.bytes, holder.saved_for_backward), ("loss_on_cpu", 0, 64 * MIB));
    assert_eq!((holder.kind.as_str(), holder.device.as_str()), ("autograd graph", "cuda:0"));
}

#[test]
fn a_container_read_in_part_is_named_with_how_much_of_it_was_read() {
    let mut g = Graph::default();
    let first = g.tensor(1, MIB);
    let large = g.add(Fake::Large(vec![(Edge::Index(0), first)], 250_000));
    let other = g.tensor(2, MIB);
    let small = g.add(Fake::Large(vec![(Edge::Index(0), other)], ELEMENTS_READ as u64));
    let emb = g.word("emb");
    let frame = g.add(Fake::Plain(vec![(Edge::Key(emb), large)]));
    let survey = hunt(&mut g, vec![root(RootKind::Name, "df", frame), root(RootKind::Name, "fits", small)]);
    let read = ELEMENTS_READ as u64;
    assert_eq!(survey.partly_read, vec![PartlyRead { path: "df['emb']".into(), elements: 250_000, read }]);
    let walked = vec![("df['emb'][0]".into(), MIB, 0), ("fits[0]".into(), MIB, 0)];
    assert_eq!(paths(&survey), walked, "what it read is walked as ever");
}

#[test]
fn a_list_of_outputs_each_keeping_its_graph_is_one_row_under_its_name() {
    let mut g = Graph::default();
    let outs: Vec<usize> = (0..ROLL_UP_AT + 2)
        .map(|i| {
            let saved = g.tensor(500 + i, 2 * MIB);
            let grad_fn = g.add(Fake::Plain(vec![(Edge::Backward(Name::Fixed("_saved_self")), saved)]));
            let out = g.tensor(10 + i, MIB / 4);
            g.refer(out, Edge::Backward(Name::Fixed("grad_fn")), grad_fn);
            out
        })
        .collect();
    let outs = g.list(&outs);
    let few: Vec<usize> = (0..3).map(|i| g.tensor(900 + i, MIB)).collect();
    let few = g.list(&few);
    let survey = hunt(&mut g, vec![root(RootKind::Name, "outs", outs), root(RootKind::Name, "few", few)]);
    assert_eq!(survey.held.len(), ROLL_UP_AT + 2 + 3, "each tensor is still held on its own path");
    let table = survey.holders(&Memory::Cuda(0), crate::report::TensorRoles::default(), MIB, &HashSet::new(), 0.0);
    let rows: Vec<(&str, u64, u64)> =
        table.holders.iter().map(|h| (h.path.as_str(), h.bytes, h.saved_for_backward)).collect();
    let n = (ROLL_UP_AT + 2) as u64;
    assert_eq!(rows, [("outs", n * MIB / 4, n * 2 * MIB), ("few[0]", MIB, 0), ("few[1]", MIB, 0), ("few[2]", MIB, 0)]);
    assert_eq!(table.holders[0].kind, "a list of 10 tensors that require grad, each keeping its graph");
    let text = table.grid("holders").to_text();
    assert!(text.contains("a list of 10 tensors that require grad, each keeping its graph cuda:0"), "{text}");
}
