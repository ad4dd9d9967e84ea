//! Where a step's activations are, by module, and which blocks to checkpoint: the bytes each
//! module keeps alive from its forward to its backward (saved for backward), and a greedy plan
//! over the model's repeated blocks by bytes saved per forward FLOP recomputed.

use std::collections::{HashMap, HashSet};

use serde::{Deserialize, Serialize};

use crate::estimate::Rounding;

/// A module of the model, as the instrumented estimate saw it run.
#[derive(Clone, Debug, Deserialize)]
pub struct ModuleSeen {
    /// Its name in `model.named_modules()`; "" is the model.
    pub path: String,
    pub class: String,
    /// Whether it has submodules: a leaf (a Linear) is no block worth checkpointing.
    pub parent: bool,
    /// Bytes of its parameters, its submodules' included.
    pub parameters: u64,
    /// FLOPs of its forward pass, as torch's flop counter counts them (matmuls, convolutions):
    /// a float, since a large batch's count passes 2**64.
    pub forward_flops: f64,
    /// Storages its inputs were in, `(storage, bytes)`: what checkpointing keeps instead.
    pub inputs: Vec<(u64, u64)>,
}

/// A tensor autograd saved for backward: its storage, the storage's bytes, and the innermost
/// module whose forward was running ("" outside any, e.g. the loss).
#[derive(Clone, Debug, Deserialize)]
pub struct Save {
    pub storage: u64,
    pub bytes: u64,
    pub path: String,
}

/// A module with what its forward keeps for its backward.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Block {
    pub path: String,
    pub class: String,
    /// Bytes saved for backward by it and its submodules, each storage once (rounded as the
    /// device's allocator rounds).
    pub saved: u64,
    /// Bytes of its inputs: what checkpointing keeps alive in place of `saved`.
    pub kept: u64,
    pub forward_flops: f64,
    pub parameters: u64,
}

impl Block {
    /// What checkpointing it takes off the activations: what it saved, less its inputs.
    pub fn saving(&self) -> u64 {
        self.saved.saturating_sub(self.kept)
    }
}

/// The modules with what each saved for backward, in the order they were given.
pub fn blocks(modules: &[ModuleSeen], saves: &[Save], rounding: Rounding) -> Vec<Block> {
    modules
        .iter()
        .map(|module| {
            let inside = |path: &str| {
                module.path.is_empty()
                    || path == module.path
                    || path.strip_prefix(&module.path).is_some_and(|rest| rest.starts_with('.'))
            };
            let mut seen = HashSet::new();
            let saved = saves
                .iter()
                .filter(|save| inside(&save.path) && seen.insert(save.storage))
                .map(|save| rounding.block(save.bytes))
                .sum();
            let mut inputs = HashSet::new();
            let kept = module
                .inputs
                .iter()
                .filter(|(storage, _)| inputs.insert(*storage))
                .map(|(_, b)| rounding.block(*b))
                .sum();
            Block {
                path: module.path.clone(),
                class: module.class.clone(),
                saved,
                kept,
                forward_flops: module.forward_flops,
                parameters: module.parameters,
            }
        })
        .collect()
}

/// The blocks a checkpointing plan picks from: modules with submodules that have a sibling of
/// the same class (a transformer's layers, a ResNet's bottlenecks), the finest such level where
/// they nest (a ResNet's stages hold its bottlenecks), and that ran. A model without repeated
/// blocks offers its own children that have submodules.
pub fn candidates(modules: &[ModuleSeen], blocks: &[Block]) -> Vec<usize> {
    let parent_of = |path: &str| path.rsplit_once('.').map(|(parent, _)| parent.to_string()).unwrap_or_default();
    let mut siblings: HashMap<(String, &str), usize> = HashMap::new();
    for module in modules.iter().filter(|m| !m.path.is_empty()) {
        *siblings.entry((parent_of(&module.path), module.class.as_str())).or_default() += 1;
    }
    let ran = |i: usize| blocks[i].saved > 0 || blocks[i].forward_flops > 0.0;
    let repeated: Vec<usize> = (0..modules.len())
        .filter(|&i| {
            let m = &modules[i];
            !m.path.is_empty() && m.parent && siblings[&(parent_of(&m.path), m.class.as_str())] > 1 && ran(i)
        })
        .collect();
    let within = |inner: &str, outer: &str| inner.strip_prefix(outer).is_some_and(|rest| rest.starts_with('.'));
    let finest: Vec<usize> = repeated
        .iter()
        .copied()
        .filter(|&i| !repeated.iter().any(|&j| within(&modules[j].path, &modules[i].path)))
        .collect();
    if !finest.is_empty() {
        return finest;
    }
    (0..modules.len())
        .filter(|&i| modules[i].parent && !modules[i].path.is_empty() && !modules[i].path.contains('.') && ran(i))
        .collect()
}

/// Which blocks to checkpoint, and what that is predicted to take off the peak.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Plan {
    pub paths: Vec<String>,
    /// The bytes off the peak: what the blocks saved less their inputs. A block's recompute in
    /// backward brings its saved tensors back for a while, mostly after the peak's temporaries
    /// (the loss, its gradient) are gone; the estimate of the plan says where that is not so.
    pub saving: u64,
    pub forward_flops: f64,
    /// Whether the plan saves `need`; when no plan does, it is every candidate.
    pub enough: bool,
}

impl Plan {
    fn of(blocks: &[Block], picked: &[usize], need: u64) -> Plan {
        let saving: u64 = picked.iter().map(|&i| blocks[i].saving()).sum();
        Plan {
            paths: picked.iter().map(|&i| blocks[i].path.clone()).collect(),
            saving,
            forward_flops: picked.iter().map(|&i| blocks[i].forward_flops).sum(),
            enough: saving >= need,
        }
    }
}

/// The blocks that save `need` bytes at the least recompute: a greedy pick by bytes saved per
/// forward FLOP, the cheapest first, until the plan saves enough; then any block whose removal
/// still leaves enough is dropped again (the largest recompute first). `need` None: every
/// candidate, the most checkpointing can do.
pub fn plan(blocks: &[Block], candidates: &[usize], need: Option<u64>) -> Plan {
    let mut order: Vec<usize> = candidates.iter().copied().filter(|&i| blocks[i].saving() > 0).collect();
    // Bytes per FLOP, compared without division: a·d > c·b. A block that counted no FLOPs is free.
    order.sort_by(|&a, &b| {
        let (a, b) = (&blocks[a], &blocks[b]);
        let left = a.saving() as f64 * b.forward_flops;
        let right = b.saving() as f64 * a.forward_flops;
        right.total_cmp(&left).then(b.saving().cmp(&a.saving()))
    });
    let Some(need) = need else {
        return Plan::of(blocks, &order, 0);
    };
    let mut picked = Vec::new();
    for &i in &order {
        if Plan::of(blocks, &picked, need).enough {
            break;
        }
        picked.push(i);
    }
    let mut by_cost = picked.clone();
    by_cost.sort_by(|&a, &b| blocks[b].forward_flops.total_cmp(&blocks[a].forward_flops));
    for i in by_cost {
        let without: Vec<usize> = picked.iter().copied().filter(|&j| j != i).collect();
        if Plan::of(blocks, &without, need).enough {
            picked = without;
        }
    }
    // In the model's order, as a person reads it.
    picked.sort();
    Plan::of(blocks, &picked, need)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn module(path: &str, class: &str, parent: bool, flops: u64, inputs: Vec<(u64, u64)>) -> ModuleSeen {
        let forward_flops = flops as f64;
        ModuleSeen { path: path.into(), class: class.into(), parent, parameters: 10, forward_flops, inputs }
    }

    fn save(storage: u64, bytes: u64, path: &str) -> Save {
        Save { storage, bytes, path: path.into() }
    }

    /// A transformer in miniature: an embedding, three layers (each with two Linears), a head.
    fn model() -> (Vec<ModuleSeen>, Vec<Save>) {
        let mut modules =
            vec![module("", "LM", true, 700, vec![]), module("embed", "Embedding", false, 0, vec![(1, 8)])];
        modules.push(module("layers", "ModuleList", true, 0, vec![]));
        for (i, flops) in [(0, 100), (1, 100), (2, 300)] {
            modules.push(module(&format!("layers.{i}"), "Layer", true, flops, vec![(10 + i, 100)]));
            modules.push(module(&format!("layers.{i}.fc1"), "Linear", false, flops / 2, vec![(10 + i, 100)]));
            modules.push(module(&format!("layers.{i}.fc2"), "Linear", false, flops / 2, vec![(20 + i, 400)]));
        }
        modules.push(module("head", "Linear", false, 100, vec![(13, 100)]));
        let saves = vec![
            save(10, 100, "layers.0.fc1"),
            save(20, 400, "layers.0.fc2"),
            save(20, 400, "layers.0"), // the same storage saved twice counts once
            save(11, 100, "layers.1.fc1"),
            save(21, 400, "layers.1.fc2"),
            save(12, 100, "layers.2.fc1"),
            save(22, 1000, "layers.2.fc2"),
            save(13, 100, "head"),
            save(30, 50, ""),
        ];
        (modules, saves)
    }

    #[test]
    fn each_module_counts_what_it_and_its_submodules_saved_each_storage_once() {
        let (modules, saves) = model();
        let blocks = blocks(&modules, &saves, Rounding::Exact);
        let saved = |path: &str| blocks.iter().find(|b| b.path == path).unwrap().saved;
        assert_eq!(saved("layers.0"), 500);
        assert_eq!(saved("layers.0.fc2"), 400);
        assert_eq!(saved("layers"), 500 + 500 + 1100);
        assert_eq!(saved(""), 2250, "the model holds everything, the loss's saves included");
        assert_eq!(blocks.iter().find(|b| b.path == "layers.2").unwrap().saving(), 1000);
        let rounded = super::blocks(&modules, &saves, Rounding::CudaCaching);
        assert_eq!(rounded.iter().find(|b| b.path == "layers.0").unwrap().saved, 1024);
    }

    #[test]
    fn the_candidates_are_the_finest_repeated_blocks_that_ran() {
        let (mut modules, saves) = model();
        let found = |modules: &[ModuleSeen]| {
            let blocks = blocks(modules, &saves, Rounding::Exact);
            candidates(modules, &blocks).into_iter().map(|i| modules[i].path.clone()).collect::<Vec<_>>()
        };
        assert_eq!(found(&modules), ["layers.0", "layers.1", "layers.2"]);
        // Stages of repeated blocks (a ResNet's layer1, layer2) give way to the blocks in them.
        let mut staged: Vec<ModuleSeen> =
            modules.iter().map(|m| ModuleSeen { path: m.path.replace("layers", "stage1"), ..m.clone() }).collect();
        staged[2].forward_flops = 500.0; // stage1 ran
        staged.push(module("stage2", "ModuleList", true, 5, vec![]));
        assert_eq!(found(&staged)[..3], ["stage1.0", "stage1.1", "stage1.2"]);
        // Without repeated blocks, the model's children that have submodules.
        modules.retain(|m| !m.path.starts_with("layers.1") && !m.path.starts_with("layers.2"));
        assert_eq!(found(&modules), ["layers"]);
    }

    #[test]
    fn the_plan_saves_what_is_needed_at_the_least_recompute() {
        let (modules, saves) = model();
        let blocks = blocks(&modules, &saves, Rounding::Exact);
        let candidates = candidates(&modules, &blocks);
        // layers.2 saves 1000 for 300 FLOPs (3.3/FLOP); 0 and 1 save 400 for 100 (4/FLOP).
        let small = plan(&blocks, &candidates, Some(200));
        assert_eq!(
            (small.paths.clone(), small.saving, small.forward_flops, small.enough),
            (vec!["layers.0".to_string()], 400, 100.0, true)
        );
        // 1000 bytes: layers.0 and .1 save only 800, and with layers.2 they are not needed.
        let large = plan(&blocks, &candidates, Some(1000));
        assert_eq!(
            (large.paths.clone(), large.saving, large.forward_flops),
            (vec!["layers.2".to_string()], 1000, 300.0)
        );
        let too_much = plan(&blocks, &candidates, Some(10_000));
        assert!(!too_much.enough && too_much.paths.len() == 3 && too_much.saving == 1800);
        assert_eq!(plan(&blocks, &candidates, None).saving, 1800);
        assert_eq!(plan(&blocks, &[], Some(1)).paths, Vec::<String>::new());
    }

    #[test]
    fn a_block_that_is_not_needed_for_the_saving_is_dropped_again() {
        let mk = |path: &str, saved: u64, flops: u64| Block {
            path: path.into(),
            class: "B".into(),
            saved,
            kept: 0,
            forward_flops: flops as f64,
            parameters: 0,
        };
        // The cheap small block is picked first, then the big one makes it unnecessary.
        let blocks = vec![mk("a", 100, 1), mk("b", 5000, 100), mk("c", 5000, 100)];
        let picked = plan(&blocks, &[0, 1, 2], Some(5000));
        assert_eq!(picked.paths, ["b"]);
        assert_eq!(picked.saving, 5000);
    }
}
