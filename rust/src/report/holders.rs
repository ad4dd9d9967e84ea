//! What still holds memory: the objects that keep it alive, each with the path to it from
//! something a person recognises.

use serde::{Deserialize, Serialize};

use super::TensorRoles;
use crate::grid::Grid;
use crate::units::{bytes, count};

/// One object that keeps memory alive, and the way to it from something a person recognises.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holder {
    /// How to reach it: `cache[0]`, `model.encoder.layers.3.weight`, `Out[12]`, …
    pub path: String,
    pub bytes: u64,
    /// Memory its autograd graph saved for backward that nothing else holds: dropping it frees that too.
    #[serde(default)]
    pub saved_for_backward: u64,
    /// "cuda:0", "cpu".
    pub device: String,
    /// "tensor", "ndarray".
    pub kind: String,
    pub shape: String,
}

/// A container the walk read only the first elements of: what only the others hold is not named.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartlyRead {
    /// The path to it, as holders' paths are written: `embeddings`, `df['emb']`.
    pub path: String,
    pub elements: u64,
    /// How many it read, first to last.
    pub read: u64,
}

/// The containers named in a note at most; the rest are counted.
const PARTLY_READ_NAMED: usize = 3;

/// What holds memory on a device (or on the host), largest first.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Holders {
    pub device: String,
    pub holders: Vec<Holder>,
    /// Live tensors no root reaches (only C++ or an uncollected cycle refers to them).
    pub unreachable: u64,
    /// Allocated by torch with no Python tensor at all: saved for backward, CUDA graph pools, workspaces.
    pub no_python_tensor: Option<u64>,
    /// Reserved by torch's allocator but not allocated: its cache, and fragmentation.
    pub cached: Option<u64>,
    /// What the memory found is to training (parameters, gradients, ...), when it holds any.
    pub roles: Option<TensorRoles>,
    pub objects_visited: u64,
    /// Objects the walk skipped because they raised when inspected.
    #[serde(default)]
    pub skipped: u64,
    /// Whether the walk stopped at a bound before it saw everything.
    #[serde(default)]
    pub truncated: bool,
    /// Containers whose elements the walk read only in part (a very large NumPy object array
    /// or pandas column), in the walk's order.
    #[serde(default)]
    pub partly_read: Vec<PartlyRead>,
    pub seconds: f64,
    /// The smallest holder listed: smaller ones were found and left out.
    #[serde(default)]
    pub min_bytes: u64,
}

impl Holders {
    pub fn grid(&self, title: &str) -> Grid {
        let mut rows: Vec<Vec<String>> = self
            .holders
            .iter()
            .map(|h| {
                let parts = [&h.kind, &h.shape, &h.device];
                let mut what = parts.iter().filter(|p| !p.is_empty()).map(|p| p.as_str()).collect::<Vec<_>>().join(" ");
                if h.saved_for_backward > 0 {
                    what.push_str(&format!(", and {} saved for its backward", bytes(h.saved_for_backward)));
                }
                vec![h.path.clone(), bytes(h.bytes), what]
            })
            .collect();
        let mut extra = |label: &str, value: Option<u64>, what: &str| {
            if let Some(value) = value.filter(|v| *v > 0) {
                rows.push(vec![label.to_string(), bytes(value), what.to_string()]);
            }
        };
        extra("(no reachable referrer)", Some(self.unreachable), "live tensors only C++ or a cycle holds");
        extra("(no Python tensor)", self.no_python_tensor, "saved for backward, CUDA graph pools, workspaces");
        extra("(reserved, unallocated)", self.cached, "torch's cache and fragmentation: empty_cache() frees it");
        let mut notes = self.notes();
        if rows.is_empty() {
            notes.insert(0, self.nothing_found());
        }
        Grid {
            title: format!("gpuexp · {title} · {}", self.device),
            lines: Vec::new(),
            header: ["held by", "size", "what"].map(String::from).to_vec(),
            rows,
            notes,
            compact: false,
        }
    }
}

impl Holders {
    /// What an empty table means: where the hunt looked, and that nothing there held enough.
    fn nothing_found(&self) -> String {
        let (kind, place) = match self.device.as_str() {
            "host" | "cpu" => ("tensor or array", "in host memory".to_string()),
            device => ("tensor", format!("on {device}")),
        };
        format!(
            "nothing found: no {kind} of {} or more {place} is reachable from your names, IPython's outputs and \
             last traceback, any thread's frames, any module's globals (a script's own as __main__), paused \
             generators and tasks, or the interpreter's hooks (min_bytes sets the size)",
            bytes(self.min_bytes),
        )
    }

    /// The hunt's own figures, and what it could not see.
    pub fn notes(&self) -> Vec<String> {
        let mut notes = vec![format!("{} objects visited in {:.2} s", self.objects_visited, self.seconds)];
        notes.extend(crate::uninspectable::Uninspectable { count: self.skipped, first: None }.note());
        if self.truncated {
            notes.push("the walk stopped at its bound (objects or depth): some holders may be missing".into());
        }
        notes.extend(self.partly_read_note());
        notes
    }

    /// Which large containers the walk read only in part: `embeddings (the first 100,000 of
    /// 250,000 elements)`. What only their later elements hold counts as with no reachable
    /// referrer, or is not seen at all on the host.
    pub fn partly_read_note(&self) -> Option<String> {
        if self.partly_read.is_empty() {
            return None;
        }
        let named: Vec<String> = self
            .partly_read
            .iter()
            .take(PARTLY_READ_NAMED)
            .map(|p| format!("{} (the first {} of {} elements)", p.path, count(p.read), count(p.elements)))
            .collect();
        let more = match self.partly_read.len().saturating_sub(PARTLY_READ_NAMED) {
            0 => String::new(),
            n => format!(" and {n} more"),
        };
        let whose = if self.partly_read.len() == 1 { "its" } else { "their" };
        Some(format!("read in part: {}{more}, so what only {whose} later elements hold is not named", named.join(", ")))
    }

    /// The report's line for this device: the largest holders, each with where its memory was
    /// allocated when `allocated_at` knows (the trace), then what no path reaches.
    pub fn line_with(&self, allocated_at: impl Fn(&Holder) -> Option<String>) -> String {
        let named: Vec<String> = self.holders.iter().take(5).map(|h| h.phrase_at(allocated_at(h))).collect();
        let mut parts = vec![named.join(", ")];
        if self.unreachable > 0 {
            parts.push(format!("{} with no reachable referrer", bytes(self.unreachable)));
        }
        // A tensor only a container's unread elements hold counts as unreachable; on the host
        // an array so held is not counted at all. Elsewhere the note would change nothing.
        if self.unreachable > 0 || matches!(self.device.as_str(), "host" | "cpu") {
            parts.extend(self.partly_read_note());
        }
        parts.retain(|part| !part.is_empty());
        format!("still held on {}: {}", self.device, parts.join("; "))
    }
}

impl Holder {
    /// `cache[0] (1.00 GiB)`, `preds[0] (8.00 MiB, and 144.00 MiB saved for its backward)`, with
    /// where it was allocated when known: `cache[0] (1.00 GiB, allocated at In [3], line 2)`.
    pub fn phrase_at(&self, allocated_at: Option<String>) -> String {
        let at = allocated_at.map(|site| format!(", allocated at {site}")).unwrap_or_default();
        match (self.bytes, self.saved_for_backward) {
            (own, 0) => format!("{} ({}{at})", self.path, bytes(own)),
            (0, saved) => format!("{} ({} saved for its backward{at})", self.path, bytes(saved)),
            (own, saved) => format!("{} ({}, and {} saved for its backward{at})", self.path, bytes(own), bytes(saved)),
        }
    }
}

/// Renders an object path from its edges, the way a person writes it: module children,
/// parameters and buffers as dotted names (`model.encoder.layers.3.weight`).
pub fn render_path(edges: &[PathEdge]) -> String {
    let mut out = String::new();
    let mut i = 0;
    while i < edges.len() {
        match (&edges[i], edges.get(i + 1)) {
            (PathEdge::Attr(a), Some(PathEdge::Key(k)))
                if matches!(a.as_str(), "_modules" | "_parameters" | "_buffers") =>
            {
                out.push('.');
                out.push_str(k.trim_matches('\''));
                i += 2;
                continue;
            }
            (PathEdge::Root(name), _) => out.push_str(name),
            (PathEdge::Attr(a), _) => {
                out.push('.');
                out.push_str(a);
            }
            (PathEdge::Key(k), _) => out.push_str(&format!("[{k}]")),
            (PathEdge::Index(n), _) => out.push_str(&format!("[{n}]")),
            (PathEdge::Closure(name), _) => out.push_str(&format!(" (closure cell {name})")),
            (PathEdge::Frame(name), _) => out.push_str(&format!(" → {name}")),
            // A local of a root frame (a thread's): `thread "worker": run(), line 4: buf`.
            (PathEdge::Local(name), _) if i > 0 && matches!(edges[i - 1], PathEdge::Root(_)) => {
                out.push_str(&format!(": {name}"))
            }
            (PathEdge::Local(name), _) => out.push_str(&format!(" → local {name}")),
            (PathEdge::CacheEntry(call), _) => out.push_str(&format!(" (lru_cache entry for {call})")),
            (PathEdge::Referent(holder), _) => out.push_str(&format!(" (via {holder})")),
        }
        i += 1;
    }
    out
}

/// One step from an object to something it refers to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PathEdge {
    /// Where a path starts: a notebook name, `Out[3]`, `mymod.CACHE`, a traceback frame.
    Root(String),
    Attr(String),
    /// A dict key, already written as a person would (`'exp_avg'`, `model.0.weight`).
    Key(String),
    Index(usize),
    Closure(String),
    /// A frame of a traceback: "step(), line 3".
    Frame(String),
    Local(String),
    /// A result an `lru_cache` keeps, by its call: "(268435456,)".
    CacheEntry(String),
    /// A reference with no name, by the holder's type.
    Referent(String),
}

/// A tensor of shape [1] on cuda:0 that holds `bytes`, and `saved` through its graph.
#[cfg(test)]
pub(crate) fn test_tensor(path: &str, bytes: u64, saved: u64) -> Holder {
    Holder {
        path: path.into(),
        bytes,
        saved_for_backward: saved,
        device: "cuda:0".into(),
        kind: "tensor".into(),
        shape: "[1]".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn path(edges: Vec<PathEdge>) -> String {
        render_path(&edges)
    }

    #[test]
    fn module_children_and_parameters_read_as_dotted_names() {
        use PathEdge::*;
        let edges = vec![
            Root("model".into()),
            Attr("_modules".into()),
            Key("'encoder'".into()),
            Attr("_modules".into()),
            Key("'layers'".into()),
            Attr("_modules".into()),
            Key("'3'".into()),
            Attr("_parameters".into()),
            Key("'weight'".into()),
        ];
        assert_eq!(path(edges), "model.encoder.layers.3.weight");
    }

    #[test]
    fn containers_closures_and_frames() {
        use PathEdge::*;
        assert_eq!(path(vec![Root("cache".into()), Index(0)]), "cache[0]");
        assert_eq!(
            path(vec![Root("opt".into()), Attr("state".into()), Key("model.0.weight".into()), Key("'exp_avg'".into())]),
            "opt.state[model.0.weight]['exp_avg']"
        );
        assert_eq!(path(vec![Root("fn".into()), Closure("buf".into())]), "fn (closure cell buf)");
        assert_eq!(
            path(vec![Root("last traceback".into()), Frame("step(), line 3".into()), Local("held".into())]),
            "last traceback → step(), line 3 → local held"
        );
    }

    #[test]
    fn the_table_lists_holders_then_memory_without_referrers() {
        let holders = Holders {
            device: "cuda:0".into(),
            holders: vec![Holder {
                path: "cache[0]".into(),
                bytes: 1 << 30,
                device: "cuda:0".into(),
                kind: "tensor".into(),
                shape: "[1073741824]".into(),
                saved_for_backward: 0,
            }],
            unreachable: 0,
            no_python_tensor: Some(64 << 20),
            cached: Some(0),
            roles: None,
            objects_visited: 10,
            skipped: 0,
            truncated: false,
            partly_read: Vec::new(),
            seconds: 0.01,
            min_bytes: 1 << 20,
        };
        let text = holders.grid("holders").to_text();
        assert!(!text.contains("nothing found"), "{text}");
        assert!(
            text.contains("cache[0]") && text.contains("1.00 GiB") && text.contains("(no Python tensor)"),
            "{text}"
        );
        assert!(!text.contains("(reserved, unallocated)") && !text.contains("(no reachable referrer)"), "{text}");
    }

    #[test]
    fn an_empty_table_says_where_it_looked_and_that_nothing_was_there() {
        let holders = Holders { device: "cpu".into(), min_bytes: 1 << 20, objects_visited: 7, ..Holders::default() };
        let text = holders.grid("holders").to_text();
        let said = "nothing found: no tensor or array of 1.00 MiB or more in host memory is reachable from your names";
        assert!(text.contains(said) && text.contains("any module's globals (a script's own as __main__)"), "{text}");
        assert!(text.contains("7 objects visited"), "{text}");
    }

    #[test]
    fn containers_read_in_part_are_named_in_the_table_and_where_they_may_hide_a_holder_in_the_line() {
        let part = |path: &str| PartlyRead { path: path.into(), elements: 250_000, read: 100_000 };
        let mut held = Holders {
            device: "cuda:0".into(),
            holders: vec![test_tensor("arr[0]", 1 << 20, 0)],
            partly_read: vec![part("big")],
            ..Holders::default()
        };
        let note = "read in part: big (the first 100,000 of 250,000 elements), so what only its later elements \
                    hold is not named";
        assert!(held.grid("holders").to_text().contains(note), "{}", held.grid("holders").to_text());
        assert_eq!(held.line_with(|_| None), "still held on cuda:0: arr[0] (1.00 MiB)", "everything was found");
        held.unreachable = 1 << 30;
        assert!(held.line_with(|_| None).ends_with(&format!("1.00 GiB with no reachable referrer; {note}")));
        held.unreachable = 0;
        held.device = "host".into();
        assert!(held.line_with(|_| None).ends_with(note), "on the host an array so held is not counted at all");

        held.partly_read = ["a", "b", "c", "d", "e"].map(part).to_vec();
        let many = held.partly_read_note().unwrap();
        assert!(many.contains("c (the first 100,000 of 250,000 elements) and 2 more, so what only their"), "{many}");
        assert!(!many.contains("d ("), "{many}");
        held.partly_read.clear();
        assert_eq!(held.partly_read_note(), None);
    }

    #[test]
    fn the_report_line_reads_well_with_or_without_named_holders() {
        let mut held = Holders { device: "cuda:0".into(), unreachable: 1 << 30, ..Holders::default() };
        assert_eq!(held.line_with(|_| None), "still held on cuda:0: 1.00 GiB with no reachable referrer");
        held.holders = vec![test_tensor("preds[0]", 8 << 20, 144 << 20), test_tensor("cache[0]", 1 << 20, 0)];
        assert_eq!(
            held.line_with(|_| None),
            "still held on cuda:0: preds[0] (8.00 MiB, and 144.00 MiB saved for its backward), cache[0] (1.00 MiB); \
             1.00 GiB with no reachable referrer"
        );
        held.holders.push(test_tensor("loss_on_cpu", 0, 64 << 20));
        assert!(held
            .line_with(|_| None)
            .ends_with(", loss_on_cpu (64.00 MiB saved for its backward); 1.00 GiB with no reachable referrer"));
        held.holders.pop();
        let at = |h: &Holder| (h.path == "preds[0]").then(|| "In [3], line 2".to_string());
        assert!(held.line_with(at).starts_with(
            "still held on cuda:0: preds[0] (8.00 MiB, and 144.00 MiB saved for its backward, allocated at In [3], \
             line 2), cache[0] (1.00 MiB);"
        ));
        held.unreachable = 0;
        assert_eq!(
            held.line_with(|_| None),
            "still held on cuda:0: preds[0] (8.00 MiB, and 144.00 MiB saved for its backward), cache[0] (1.00 MiB)"
        );
    }

    #[test]
    fn thread_locals_cache_entries_and_unnamed_references() {
        use PathEdge::*;
        assert_eq!(
            path(vec![Root("thread \"Thread-3 (worker)\": worker(), line 4".into()), Local("buf".into())]),
            "thread \"Thread-3 (worker)\": worker(), line 4: buf"
        );
        assert_eq!(
            path(vec![Root("table".into()), CacheEntry("(268435456,)".into())]),
            "table (lru_cache entry for (268435456,))"
        );
        assert_eq!(path(vec![Root("p".into()), Referent("partial".into()), Index(0)]), "p (via partial)[0]");
    }
}
