use super::*;
use crate::grid::testing::{expected_cells, html_cells, text_cells};

const MIB: u64 = 1 << 20;

/// What Python gathers for a 4-layer model at batch 64 that is 300 MiB over a 1 GiB limit.
fn input() -> FitInput {
    let mut modules = vec![serde_json::json!({"path": "", "class": "LM", "parent": true, "parameters": 400 * MIB,
        "forward_flops": 4000, "inputs": []})];
    let mut saves = vec![serde_json::json!({"storage": 99, "bytes": 10 * MIB, "path": ""})];
    for i in 0..4u64 {
        modules.push(serde_json::json!({"path": format!("layers.{i}"), "class": "Layer", "parent": true,
            "parameters": 100 * MIB, "forward_flops": 1000, "inputs": [[i, 20 * MIB]]}));
        modules.push(serde_json::json!({"path": format!("layers.{i}.fc"), "class": "Linear", "parent": false,
            "parameters": 100 * MIB, "forward_flops": 1000, "inputs": [[i, 20 * MIB]]}));
        saves.push(serde_json::json!({"storage": i, "bytes": 20 * MIB, "path": format!("layers.{i}.fc")}));
        saves.push(serde_json::json!({"storage": 10 + i, "bytes": 180 * MIB, "path": format!("layers.{i}")}));
    }
    let json = serde_json::json!({
        "batch_size": 64, "device": "cuda:0", "now": 1024 * MIB,
        "fits": [{"against": "free memory", "room": 8192 * MIB, "needed": 1324 * MIB},
                 {"against": "limit", "room": 2048 * MIB, "needed": 2348 * MIB}],
        "peak": 1324 * MIB,
        "categories": {"parameters": 400 * MIB, "buffers": 0, "gradients": 0, "optimizer_state": 800 * MIB,
                       "activations": 810 * MIB, "temporaries": 14 * MIB},
        "modules": modules, "saves": saves, "step_flops": 12000,
        "model": {"name": "net", "class": "LM", "library_switch": null, "dtype": "float32"},
        "optimizer": {"name": "opt", "class": "AdamW", "state_bytes": 800 * MIB, "parameter_bytes": 400 * MIB,
                      "foreach": true, "fusable": true},
        "gradient_bytes": 400 * MIB,
        "half": {"batch_size": 32, "peak": 924 * MIB, "gradients_at_peak": 100 * MIB},
        "runs": [], "last_oom_cached": null, "verified": null, "estimates": 2, "seconds": 0.5,
    });
    serde_json::from_value(json).expect("Python's input parses")
}

#[test]
fn the_budget_is_the_tightest_answer_and_the_need_is_what_is_over_it() {
    let input = input();
    // The limit leaves 2048 - 1024 MiB for the peak; free memory leaves 8192.
    assert_eq!(input.budget(), Some(Budget { bytes: 1024 * MIB, against: "limit".into() }));
    assert_eq!(input.need(), Some(300 * MIB));
    let plan = input.checkpoint_plan(0);
    // Each layer saves 200 MiB and keeps its 20 MiB input: 180 net. 300 MiB and 2% of the peak
    // need two layers; 200 MiB more (what an estimate of them fell short by), three.
    assert_eq!(plan.paths, ["layers.0", "layers.1"]);
    assert_eq!(plan.saving, 2 * 180 * MIB);
    assert!(plan.enough);
    assert_eq!(input.checkpoint_plan(200 * MIB).paths.len(), 3);
}

#[test]
fn accumulation_takes_the_fewest_micro_batches_that_fit() {
    let mut input = input();
    // At 32 the step peaks at 924 MiB with 100 MiB of its 400 MiB of gradients live: 1224 > 1024.
    // The line (400 MiB per 32 samples) puts 16 at 724, + 300 = 1024: fits.
    let plan = Accumulation {
        k: 4,
        micro_batch: 16,
        step_peak: 724 * MIB,
        gradients_at_peak: 100 * MIB,
        predicted: 1024 * MIB,
    };
    assert_eq!(accumulation(&input), Some(plan));
    input.fits.clear();
    assert_eq!(accumulation(&input).map(|a| a.k), Some(2), "without a budget, two micro-batches");
    input.half = None;
    assert_eq!(accumulation(&input), None);
}

fn with_runs() -> FitInput {
    let mut input = input();
    let runs = serde_json::json!([
        {"option": "checkpoint", "peak": 1000 * MIB, "paths": ["layers.0", "layers.1", "layers.2"]},
        {"option": "autocast", "peak": 900 * MIB},
        {"option": "accumulate", "peak": 724 * MIB, "micro_batch": 16, "gradients_at_peak": 100 * MIB},
        {"option": "foreach_off", "peak": null, "error": "no estimate was made: the step failed under fake tensors at aten.nonzero.default"},
    ]);
    input.runs = serde_json::from_value(runs).unwrap();
    input.last_oom_cached = Some(512 * MIB);
    input
}

#[test]
fn the_options_are_ranked_by_what_they_save_and_those_without_an_estimate_come_last() {
    let report = FitReport::new(&with_runs());
    assert_eq!((report.fits, report.short), (Some(false), Some(300 * MIB)));
    let order: Vec<Choice> = report.options.iter().map(|o| o.option).collect();
    // Autocast saves 424, checkpointing 324, accumulation (724 + the 300 MiB of gradients kept)
    // 300, as does the smaller batch (the line, 12.5 MiB a sample from 524 MiB, reaches 1 GiB at 40).
    assert_eq!(
        order,
        [Choice::Autocast, Choice::Checkpoint, Choice::Accumulate, Choice::SmallerBatch, Choice::ForeachOff]
    );
    let option = |choice| report.options.iter().find(|o| o.option == choice).unwrap();
    assert_eq!(option(Choice::Accumulate).peak, Some(1024 * MIB));
    assert_eq!(option(Choice::Accumulate).fits, Some(true));
    assert_eq!(report.largest_batch, Some(40));
    // The table lists the blocks a plan picks from, not their Linears nor the model.
    let listed: Vec<&str> = report.blocks.iter().map(|b| b.path.as_str()).collect();
    assert_eq!(listed, ["layers.0", "layers.1", "layers.2", "layers.3"]);
    let checkpoint = option(Choice::Checkpoint);
    assert_eq!(checkpoint.title, "checkpoint 3 of 4 blocks (layers.0, layers.1, layers.2)");
    assert!(checkpoint.cost.starts_with("recomputes 25% of the step's FLOPs"), "{}", checkpoint.cost);
    assert!(checkpoint
        .code
        .contains("with gpuexp.checkpointed(net, [\"layers.0\", \"layers.1\", \"layers.2\"]):\n    step(64)"));
    assert_eq!(checkpoint.recompute_share, Some(0.25));
    assert_eq!(checkpoint.paths.len(), 3);
    assert_eq!(option(Choice::Accumulate).batch_size, Some(16));
    assert_eq!(option(Choice::SmallerBatch).batch_size, Some(40));
    // The line's fixed part is 524 MiB; checkpointing's 476 MiB at 64 is 7.44 MiB a sample: 67 fit.
    assert_eq!(checkpoint.largest_batch, Some(67));
    assert_eq!(option(Choice::Accumulate).largest_batch, None);
    let raises = report.raises(40).unwrap();
    assert!(raises.starts_with("to reach 64, gpuexp.fit(step, 64) says: autocast to bfloat16 to about 85 (autocast the step to bfloat16); \
         activation checkpointing to about 67"), "{raises}");
    assert!(FitReport::new(&input()).raises(40).unwrap().contains("no option that raises the batch above 40"));
    assert!(option(Choice::ForeachOff).refused.as_deref().unwrap().contains("aten.nonzero"));
    assert_eq!(report.best().map(|o| o.option), Some(Choice::Autocast));
    // 512 MiB cached at the last OOM, more than the 300 MiB gap.
    assert!(report.hints[0].contains("expandable_segments:True"), "{:?}", report.hints);
}

#[test]
fn the_tables_show_why_the_modules_and_the_options_and_the_code() {
    let mut input = with_runs();
    input.verified = Some(Verified {
        option: Choice::Checkpoint,
        predicted_peak: 1000 * MIB,
        measured_peak: 1020 * MIB,
        baseline_peak: Some(1330 * MIB),
        seconds: Some(0.2),
        baseline_seconds: Some(0.15),
        forward_seconds: Default::default(),
        recompute: None,
        predicted_seconds: None,
        error: None,
        stranded: None,
        paths: vec!["layers.0".into()],
        widened: None,
    });
    let report = FitReport::new(&input);
    let view = report.view();
    assert_eq!(view.grids.len(), 4);
    for grid in &view.grids {
        assert_eq!(text_cells(&grid.to_text()), expected_cells(grid));
        assert_eq!(html_cells(&grid.to_html()), expected_cells(grid));
    }
    let text = view.to_text();
    assert!(text.contains("the budget is 1.00 GiB (limit): 300.00 MiB short"), "{text}");
    assert_eq!(view.grids[1].rows[0], ["layers.0 (Layer)", "200.00 MiB", "100.00 MiB", "8.3%"]);
    assert!(text.contains("the measured peak is +2.0% off the prediction"), "{text}");
    assert!(text.contains("gradient accumulation: no estimate") || text.contains("per-parameter loop: no estimate"));
    assert!(
        text.contains("how to apply each:\n1. autocast the step to bfloat16:\n    import torch\n\n    with"),
        "{text}"
    );
    assert!(!text.lines().any(|line| line.ends_with(' ')), "no line ends in a space: {text}");
    assert!(text.contains("batch size 40, the largest that fits as the step is"), "{text}");
    assert!(!text.contains("the largest batch that fits as the step is: about"), "said once, as the option: {text}");
    let html = view.to_html();
    assert!(html.contains("<pre>import gpuexp\n\nwith gpuexp.checkpointed(net"), "{html}");
    let json = serde_json::to_value(&report).unwrap();
    assert_eq!(json["options"][0]["option"], "autocast");
    assert_eq!(json["budget"]["against"], "limit");
    assert_eq!(json["blocks"][0]["saved"], 200 * MIB);
    assert_eq!(json["verified"]["measured_peak"], 1020 * MIB);
}

#[test]
fn a_step_that_fits_says_so_and_offers_no_smaller_batch() {
    let mut input = input();
    input.fits.pop();
    input.skipped = vec![(Choice::Autocast, "the model's parameters are bfloat16 already".into())];
    let report = FitReport::new(&input);
    assert_eq!(report.notes, ["autocast to bfloat16: not offered: the model's parameters are bfloat16 already"]);
    assert_eq!(report.fits, Some(true));
    assert!(report.verdict().contains("it fits the budget of 8.00 GiB (free memory)"), "{}", report.verdict());
    assert!(report.options.is_empty());
    assert!(report.hints.is_empty());
}

#[test]
fn a_plan_widened_after_fragmentation_and_a_step_that_still_ran_out_say_what_was_stranded() {
    let verified = |error: Option<&str>, stranded: Option<u64>| Verified {
        option: Choice::Checkpoint,
        predicted_peak: 900 * MIB,
        measured_peak: 880 * MIB,
        baseline_peak: Some(1330 * MIB),
        seconds: Some(0.2),
        baseline_seconds: Some(0.15),
        forward_seconds: Default::default(),
        recompute: None,
        predicted_seconds: None,
        error: error.map(String::from),
        stranded,
        paths: vec!["layers.0".into(), "layers.1".into()],
        widened: Some(Widened { paths: vec!["layers.0".into()], stranded: 551 * MIB }),
    };
    let mut input = with_runs();
    input.verified = Some(verified(None, None));
    let text = FitReport::new(&input).view().to_text();
    assert!(
        text.contains("the first plan (1 block) ran out of memory in its real step with 551.00 MiB reserved"),
        "{text}"
    );
    assert!(!text.contains("reserved but unallocated as it ran out"), "{text}");
    input.verified = Some(verified(Some("CUDA out of memory"), Some(300 * MIB)));
    let report = FitReport::new(&input);
    let text = report.view().to_text();
    assert!(text.contains("the real step failed: CUDA out of memory"), "{text}");
    assert!(text.contains("300.00 MiB was reserved but unallocated as it ran out: fragmentation"), "{text}");
    let json = serde_json::to_value(&report).unwrap();
    assert_eq!(json["verified"]["widened"]["stranded"], 551 * MIB);
    assert_eq!(json["verified"]["paths"][1], "layers.1");
}

#[test]
fn the_recompute_is_the_blocks_timed_forwards_where_each_was_timed_else_their_flop_share() {
    let mut input = with_runs();
    let verified = |forward_seconds: &[(&str, f64)]| Verified {
        option: Choice::Checkpoint,
        predicted_peak: 1000 * MIB,
        measured_peak: 1000 * MIB,
        baseline_peak: Some(1330 * MIB),
        seconds: Some(0.2),
        baseline_seconds: Some(0.15),
        forward_seconds: forward_seconds.iter().map(|(p, s)| (p.to_string(), *s)).collect(),
        recompute: None,
        predicted_seconds: Some(9.0), // the runner's figure is not the core's: it is replaced
        error: None,
        stranded: None,
        paths: vec!["layers.0".into(), "layers.1".into()],
        widened: None,
    };
    // Both blocks timed (a third one, not checkpointed, is left out): 20 + 25 ms.
    input.verified = Some(verified(&[("layers.0", 0.020), ("layers.1", 0.025), ("layers.2", 0.5)]));
    let report = FitReport::new(&input);
    let checked = report.verified.as_ref().unwrap();
    let recompute = checked.recompute.as_ref().unwrap();
    assert!(recompute.timed);
    assert!((recompute.seconds - 0.045).abs() < 1e-12, "{recompute:?}");
    // Their FLOPs are 2 × 1000 of the step's 12000: 1/6 of 150 ms.
    assert!((recompute.by_flops.unwrap() - 0.025).abs() < 1e-12, "{recompute:?}");
    assert!((checked.predicted_seconds.unwrap() - 0.195).abs() < 1e-12);
    let text = report.view().to_text();
    assert!(
        text.contains(
            "recompute predicted 45.0 ms: the checkpointed blocks' forwards to their last saved tensor, timed in the step as it is; \
         by their share of the step's FLOPs, 25.0 ms; measured 50.0 ms"
        ),
        "{text}"
    );
    // One block untimed: the FLOP share is what is left.
    input.verified = Some(verified(&[("layers.0", 0.020)]));
    let report = FitReport::new(&input);
    let checked = report.verified.as_ref().unwrap();
    assert!(!checked.recompute.as_ref().unwrap().timed);
    assert!((checked.predicted_seconds.unwrap() - 0.175).abs() < 1e-12);
    assert!(report.view().to_text().contains("recompute predicted 25.0 ms: the blocks' share of the step's FLOPs"));
    // Without the step as it is (it ran out of memory), nothing is predicted.
    let mut unmeasured = verified(&[("layers.0", 0.020), ("layers.1", 0.025)]);
    unmeasured.baseline_seconds = None;
    input.verified = Some(unmeasured);
    let report = FitReport::new(&input);
    assert_eq!(report.verified.as_ref().unwrap().predicted_seconds, None);
    assert!(!report.view().to_text().contains("recompute predicted"));
}
