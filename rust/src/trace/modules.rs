//! The `nn.Module` an allocation was made in, from the marks gpuexp's hooks
//! (python/gpuexp/module_paths.py) set as torch's memory metadata while a traced experiment runs:
//! `forward N: model.layers.3.attn` in the calling thread, `backward N: model.layers.3.attn` in
//! autograd's. `N` numbers the forward passes: autograd's thread keeps its last mark after a
//! backward ends, so a backward mark older than the latest forward pass (the loss's own backward
//! runs before any module's) is stale and dropped.
//!
//! Sites group modules by family, layer indices folded (`model.layers.*.attn`), so a 24-layer
//! model gives one row per kind of module, not 24.

use std::collections::{BTreeSet, HashMap};

use super::parse::Stacks;

/// One mark as the hooks write it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModuleMark {
    pub backward: bool,
    pub pass: u64,
    pub path: String,
}

impl ModuleMark {
    /// None for metadata that is not gpuexp's (a user's own, in a loaded snapshot).
    pub fn parse(text: &str) -> Option<ModuleMark> {
        let (head, path) = text.split_once(": ")?;
        let (direction, pass) = head.split_once(' ')?;
        let backward = match direction {
            "forward" => false,
            "backward" => true,
            _ => return None,
        };
        if path.is_empty() {
            return None;
        }
        Some(ModuleMark { backward, pass: pass.parse().ok()?, path: path.to_string() })
    }
}

/// `model.layers.3.attn` → `model.layers.*.attn`.
pub fn family_of(path: &str) -> String {
    path.split('.')
        .map(|part| if !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()) { "*" } else { part })
        .collect::<Vec<_>>()
        .join(".")
}

/// Modules of one kind, in one direction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModuleFamily {
    pub backward: bool,
    pub family: String,
    /// The exact paths seen.
    pub paths: BTreeSet<String>,
}

impl ModuleFamily {
    /// `model.layers.3.attn` for one module, `model.layers.*.attn (6 modules)` for several.
    pub fn label(&self) -> String {
        match self.paths.len() {
            1 => self.paths.first().cloned().unwrap_or_default(),
            n => format!("{} ({n} modules)", self.family),
        }
    }
}

/// A metadata string read once: its direction, its forward pass and its family.
#[derive(Clone, Copy, Debug)]
struct Marked {
    backward: bool,
    pass: u64,
    family: u32,
}

/// The families a replay met, and the state that reads marks in trace order.
#[derive(Clone, Debug, Default)]
pub struct Modules {
    pub families: Vec<ModuleFamily>,
    index: HashMap<(bool, String), u32>,
    /// Each distinct metadata string, parsed once: a trace repeats a few hundred of them.
    marks: HashMap<u32, Option<Marked>>,
    latest_forward: u64,
}

impl Modules {
    /// The family of the next event, whose metadata string is `annotation`: None where it has
    /// no mark, or a stale backward one.
    pub fn observe(&mut self, stacks: &Stacks, annotation: Option<u32>) -> Option<u32> {
        let text = annotation?;
        let marked = match self.marks.get(&text) {
            Some(marked) => *marked,
            None => {
                let marked = ModuleMark::parse(stacks.string(text)).map(|mark| self.read(mark));
                self.marks.insert(text, marked);
                marked
            }
        }?;
        if marked.backward && marked.pass < self.latest_forward {
            return None;
        }
        if !marked.backward {
            self.latest_forward = self.latest_forward.max(marked.pass);
        }
        Some(marked.family)
    }

    fn read(&mut self, mark: ModuleMark) -> Marked {
        let family = family_of(&mark.path);
        let next = self.families.len() as u32;
        let id = *self.index.entry((mark.backward, family.clone())).or_insert(next);
        if id == next {
            self.families.push(ModuleFamily { backward: mark.backward, family, paths: BTreeSet::new() });
        }
        self.families[id as usize].paths.insert(mark.path);
        Marked { backward: mark.backward, pass: mark.pass, family: id }
    }

    pub fn family(&self, id: u32) -> &ModuleFamily {
        &self.families[id as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_parse_and_others_are_not_marks() {
        let mark = ModuleMark::parse("backward 7: model.layers.3.attn").unwrap();
        assert_eq!(mark, ModuleMark { backward: true, pass: 7, path: "model.layers.3.attn".into() });
        assert!(ModuleMark::parse("forward 2: model").is_some_and(|m| !m.backward));
        for other in ["", "{\"step\": 3}", "forward x: model", "sideways 1: model", "forward 1: "] {
            assert_eq!(ModuleMark::parse(other), None, "{other}");
        }
    }

    #[test]
    fn layer_indices_fold_into_one_family() {
        assert_eq!(family_of("model.layers.11.attn.q_proj"), "model.layers.*.attn.q_proj");
        assert_eq!(family_of("net.0"), "net.*");
        assert_eq!(family_of("h2o.block"), "h2o.block");
    }

    /// A library model called on one user line: its layers' rows apart by module family, the
    /// loss's backward (which runs before any module's, under the last pass's stale mark) as
    /// plain backward, and the layers' backward by module.
    #[test]
    fn sites_carry_their_module_and_backward_blocks_their_module_too() {
        use crate::trace::tests::{attribution, Program};
        use crate::trace::{peak_sites, replay, PlainNamer, SiteRule};
        let mut p = Program::new();
        let call = p.line(30);
        let pass = |p: &mut Program, number: u32, acts: &mut Vec<u64>| {
            for layer in 0..2 {
                p.mark(&format!("forward {number}: model.layers.{layer}.mlp"));
                acts.push(p.alloc(3 << 20, call, "mlp"));
                p.mark(&format!("forward {number}: model.layers.{layer}.attn"));
                acts.push(p.alloc(5 << 20, call, "attn"));
            }
            p.mark(&format!("forward {number}: model.head"));
            acts.push(p.alloc(1 << 20, call, "head"));
            p.mark("");
        };
        let mut acts = Vec::new();
        pass(&mut p, 1, &mut acts);
        p.mark("backward 1: model.layers.0.attn");
        let grad = p.alloc(7 << 20, 0, "bwd");
        p.free(grad);
        acts.drain(..).for_each(|a| p.free(a));
        pass(&mut p, 2, &mut acts);
        // Pass 2's loss backward: autograd's thread still carries pass 1's mark.
        let backward = p
            .stack(&[("/site-packages/torch/autograd/__init__.py", 200, "backward"), ("/home/u/train.py", 31, "step")]);
        p.event(crate::trace::Action::AllocationHistory, backward);
        p.alloc(11 << 20, 0, "loss");
        p.mark("backward 2: model.layers.1.attn");
        p.alloc(13 << 20, 0, "bwd");
        let (snapshot, _, _) = p.snapshot(0);
        let (rule, namer) = (SiteRule::default(), PlainNamer::default());
        let replay = replay(&snapshot, 0, None);
        let table = peak_sites(&replay, &attribution(&snapshot, &rule, &namer), 10).table;
        let bytes_of = |label: &str| table.all.iter().find(|row| row.label == label).map(|row| row.bytes);
        let user = "/home/u/train.py:30";
        assert_eq!(bytes_of(&format!("{user} in model.layers.*.attn (2 modules)")), Some(10 << 20));
        assert_eq!(bytes_of(&format!("{user} in model.layers.*.mlp (2 modules)")), Some(6 << 20));
        assert_eq!(bytes_of(&format!("{user} in model.head")), Some(1 << 20));
        let from = "at /home/u/train.py:31";
        assert_eq!(bytes_of(&format!("backward of model.layers.*.attn (2 modules) {from}")), Some(13 << 20));
        assert_eq!(bytes_of(&format!("backward {from}")), Some(11 << 20));
    }

    #[test]
    fn a_backward_mark_older_than_the_latest_forward_is_stale() {
        let mut stacks = Stacks::default();
        let marks: Vec<u32> = [
            "forward 1: m.layers.0",
            "backward 1: m.layers.0",
            "forward 2: m.layers.1",
            "backward 1: m.layers.0",
            "backward 2: m.layers.1",
        ]
        .iter()
        .map(|text| stacks.intern_string(text))
        .collect();
        let mut modules = Modules::default();
        let seen: Vec<Option<u32>> = marks.iter().map(|&m| modules.observe(&stacks, Some(m))).collect();
        assert_eq!(seen, vec![Some(0), Some(1), Some(0), None, Some(1)]);
        assert_eq!(modules.family(0).label(), "m.layers.* (2 modules)");
        assert_eq!(modules.family(1).label(), "m.layers.* (2 modules)");
        assert!(modules.family(1).backward);
        assert_eq!(modules.observe(&stacks, None), None);
    }
}
