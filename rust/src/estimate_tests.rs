use super::*;
use crate::grid::testing::{expected_cells, html_cells, text_cells};

#[test]
fn cuda_blocks_round_as_the_caching_allocator_does() {
    // Figures measured on an H100 (torch 2.11): memory_allocated() after one allocation.
    let measured = [
        (1, 512),
        (511, 512),
        (513, 1024),
        (4000, 4096),
        (1 << 20, 1 << 20),
        ((1 << 20) + 1, 1049088),
        (3 << 20, 3 << 20),
        ((10 << 20) + 100, 10486272),
        ((11 << 20) + 300 * 1024, 12 << 20),
        ((11 << 20) + 900 * 1024, 12 << 20),
        ((33 << 20) + 5, 34 << 20),
        (100 << 20, 100 << 20),
        ((100 << 20) + (1536 << 10), 106954752),
    ];
    for (n, allocated) in measured {
        assert_eq!(Rounding::CudaCaching.block(n), allocated, "{n} bytes");
    }
    assert_eq!(Rounding::CudaCaching.block(0), 0);
    assert_eq!(Rounding::Exact.block(513), 513);
}

/// A training step in miniature: weights and Adam state exist; the forward pass makes an
/// activation it saves and a temporary it frees; backward makes a gradient and a scratch
/// buffer; the optimizer makes scratch.
fn training_step() -> Ledger {
    let mut ledger = Ledger::new(Rounding::Exact);
    ledger.existing(100, Category::Parameters);
    ledger.existing(200, Category::OptimizerState);
    let saved = ledger.made(1000);
    let temporary = ledger.made(300);
    ledger.freed(temporary);
    ledger.enter(Phase::Backward);
    let gradient = ledger.made(100);
    let scratch = ledger.made(50);
    ledger.freed(scratch);
    ledger.freed(saved);
    ledger.mark(gradient, Category::Gradients);
    ledger.enter(Phase::Optimizer);
    let update = ledger.made(100);
    ledger.freed(update);
    ledger.enter(Phase::Forward);
    ledger.count_op();
    ledger
}

#[test]
fn the_peak_is_above_the_start_and_says_what_was_live() {
    let peak = training_step().peak();
    // Live above the start: 1000 + 300 (the temporary), then 1000 + 100 + 50 in backward.
    assert_eq!(peak.above_start, 1300);
    assert_eq!(peak.existing, 300);
    let expected = Categories {
        parameters: 100,
        optimizer_state: 200,
        activations: 1000,
        temporaries: 300,
        ..Categories::default()
    };
    assert_eq!(peak.categories, expected);
    assert_eq!(peak.categories.total(), peak.above_start + peak.existing);
    assert_eq!(peak.ops, 1);
}

#[test]
fn a_gradient_counts_as_one_even_before_it_is_marked_and_after_it_is_freed() {
    let mut ledger = Ledger::new(Rounding::Exact);
    ledger.enter(Phase::Backward);
    let gradient = ledger.made(500);
    ledger.freed(gradient); // zero_grad(set_to_none=True) at the end of the step
    ledger.mark(gradient, Category::Gradients);
    assert_eq!(ledger.peak().categories.gradients, 500);
}

#[test]
fn freeing_what_existed_makes_room_and_existing_entries_cannot_be_remarked() {
    let mut ledger = Ledger::new(Rounding::Exact);
    let old_gradient = ledger.existing(400, Category::Gradients);
    ledger.mark(old_gradient, Category::Temporaries);
    ledger.freed(old_gradient);
    ledger.freed(old_gradient);
    let activation = ledger.made(300);
    let peak = ledger.peak();
    assert_eq!(peak.above_start, 0, "the step never went above where it started");
    assert_eq!(peak.categories.gradients, 400);
    ledger.grew(activation, 900);
    assert_eq!(ledger.peak().above_start, 500);
}

#[test]
fn a_model_planned_on_meta_counts_its_weights_above_the_start() {
    let mut ledger = Ledger::new(Rounding::Exact);
    ledger.loaded(100, Category::Parameters);
    ledger.loaded(40, Category::Buffers);
    let temporary = ledger.made(300);
    ledger.freed(temporary);
    let peak = ledger.peak();
    assert_eq!((peak.above_start, peak.existing), (440, 0));
    let categories = (peak.categories.parameters, peak.categories.buffers, peak.categories.temporaries);
    assert_eq!(categories, (100, 40, 300));
}

#[test]
fn an_inference_step_keeps_its_output_as_an_activation() {
    let mut ledger = Ledger::new(Rounding::Exact);
    let hidden = ledger.made(800);
    let output = ledger.made(10);
    ledger.freed(hidden);
    let peak = ledger.peak();
    assert_eq!((peak.categories.temporaries, peak.categories.activations), (800, 10));
    let _ = output;
}

fn estimate(limit: Option<u64>, device: &str) -> Estimate {
    let room = Room { device: device.into(), now: 2 << 30, free: Some(10 << 30), limit };
    Estimate::new(64, 1, training_step().peak(), &room, 0.12, vec!["a note".into()])
}

#[test]
fn it_answers_does_it_fit_against_free_memory_and_a_limit() {
    let fits = estimate(Some(24 << 30), "cuda:0").fits;
    assert_eq!(fits.len(), 2);
    assert!(fits[0].fits && fits[0].answer.starts_with("fits the free memory of cuda:0 (10.00 GiB): yes, "));
    assert_eq!(fits[1].needed, (2 << 30) + 1300);
    assert_eq!(fits[1].spare, (22 << 30) - 1300);
    let short = estimate(Some(2 << 30), "cuda:0").fits.remove(1);
    assert_eq!((short.fits, short.spare), (false, -1300));
    assert_eq!(short.answer, "fits a 2.00 GiB card: no, 1.27 KiB short");
    let host = estimate(Some(16 << 30), "cpu").fits.remove(1);
    assert!(host.answer.starts_with("fits in 16.00 GiB of host memory: yes"), "{}", host.answer);
    assert_eq!(estimate(None, "cpu").fits.len(), 1);
    let room = Room { device: "cuda:0".into(), now: 0, free: None, limit: None };
    let unknown = Estimate::new(8, 1, training_step().peak(), &room, 0.1, Vec::new());
    assert!(unknown.fits.is_empty() && unknown.notes[0].contains("free memory is unknown"), "{unknown:?}");
}

#[test]
fn the_table_lists_each_category_and_the_answers() {
    let estimate = estimate(Some(24 << 30), "cuda:0");
    let grid = estimate.grid();
    assert_eq!(text_cells(&grid.to_text()), expected_cells(&grid));
    assert_eq!(html_cells(&grid.to_html()), expected_cells(&grid));
    let labels: Vec<&str> = grid.rows.iter().map(|r| r[0].as_str()).collect();
    assert_eq!(
        labels,
        [
            "parameters",
            "optimizer state",
            "activations and saved tensors",
            "temporaries",
            "the step's tensors at the peak"
        ]
    );
    let text = grid.to_text();
    assert!(text.contains("predicted peak: +1.27 KiB torch allocated above the 2.00 GiB allocated now"), "{text}");
    assert!(text.contains("fits a 24.00 GiB card: yes") && text.ends_with("note: a note"), "{text}");
    let json: serde_json::Value = serde_json::to_value(&estimate).unwrap();
    assert_eq!(json["peak"], 1300);
    let mut keys: Vec<&str> = json["categories"].as_object().unwrap().keys().map(String::as_str).collect();
    keys.sort();
    assert_eq!(keys, ["activations", "buffers", "gradients", "optimizer_state", "parameters", "temporaries"]);
}

#[test]
fn the_peak_says_which_phase_it_fell_in() {
    let mut ledger = Ledger::new(Rounding::Exact);
    let activation = ledger.made(300);
    ledger.enter(Phase::Backward);
    let gradient = ledger.made(200);
    ledger.freed(activation);
    ledger.enter(Phase::Optimizer);
    let temporary = ledger.made(100);
    ledger.freed(temporary);
    assert_eq!(ledger.peak().phase, Phase::Backward, "500 in backward; the optimizer reached 300");
    let larger = ledger.made(400);
    ledger.freed(larger);
    assert_eq!((ledger.peak().above_start, ledger.peak().phase), (600, Phase::Optimizer));
    let _ = gradient;
}
