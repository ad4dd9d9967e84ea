"""Exact, always (`pytest -m gpu`): a traced experiment's peak and its rows equal torch's
`max_memory_allocated` over it to the byte, also in a kernel's first traced experiment where
blocks allocated before the recording are freed in it; a snapshot gpuexp saved replays the same
when loaded; and a torch snapshot of a real training run (torch's own `_dump_snapshot`) gives a
bound that holds the true peak."""

import pytest

pytestmark = pytest.mark.gpu


def model_and_optimizer(width):
    """A model of 4 MLP blocks of `width` on the GPU, and its AdamW."""
    return f"""\
import torch, gpuexp
torch.manual_seed(0)
nn = torch.nn
model = nn.Sequential(*[nn.Sequential(nn.LayerNorm({width}), nn.Linear({width}, {4 * width}), nn.GELU(),
                                      nn.Linear({4 * width}, {width})) for _ in range(4)]).cuda()
opt = torch.optim.AdamW(model.parameters())
"""


# A model trained a step before any recording: its weights, Adam's state, and blocks of odd sizes
# (19.2 MiB asked for, 20 MiB given: cut whole from a fresh segment) made before it.
BEFORE = model_and_optimizer(1024) + """\
def step(bs):
    x = torch.randn(bs, 1024, device="cuda")
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
step(64)
odd = [torch.empty(int(19.2 * 2**20), dtype=torch.uint8, device="cuda"), torch.empty(2_700_000, device="cuda"),
       torch.empty(5_000_001, dtype=torch.uint8, device="cuda")]
torch.cuda.synchronize()"""

IN_THE_EXPERIMENT = """\
del odd
step(256)
step(512)
scope_peak = torch.cuda.max_memory_allocated()"""


def rows_total(peak):
    return sum(row["bytes"] for row in peak["sites"]) + peak["rest"]["bytes"]


def test_a_kernel_s_first_traced_experiment_peaks_at_torch_s_figure_to_the_byte(kernel, tmp_path):
    kernel.run(BEFORE)
    kernel.run("exp = gpuexp.GPUExperiment('first', trace=True)")
    kernel.run(IN_THE_EXPERIMENT)
    scope_peak = kernel.value("scope_peak")
    kernel.run("exp.finish()")
    report = kernel.value("exp.data.to_dict()")
    (device,) = report["trace"]
    peak = device["peak"]
    assert peak["peak"]["bytes"] == scope_peak == report["gpus"][0]["torch_allocated"]["peak"], peak["completeness"]
    assert rows_total(peak) == scope_peak, "the rows add up to the peak"
    assert peak["completeness"]["sized_from_opening"] >= 3, peak["completeness"]
    assert "bounds" not in peak and peak["true_peak"] == scope_peak
    print(f"first traced experiment: peak {scope_peak} bytes, {peak['completeness']}")
    out = tmp_path / "first.pickle"
    kernel.run(f"exp.data.save_snapshot({str(out)!r})\nloaded = gpuexp.load_snapshot({str(out)!r})")
    (loaded,) = kernel.value("loaded.to_dict()")
    assert loaded["peak"]["peak"]["bytes"] == scope_peak == loaded["peak"]["true_peak"], "saved, then loaded: the same"
    assert rows_total(loaded["peak"]) == scope_peak
    keys = kernel.value(f"sorted(__import__('pickle').load(open({str(out)!r}, 'rb')))")
    assert {"segments", "device_traces", "gpuexp"} <= set(keys), "torch's keys, as memory_viz reads them, and gpuexp's"


def test_a_torch_snapshot_of_a_training_run_gives_a_bound_that_holds_the_true_peak(kernel, tmp_path):
    out = tmp_path / "torch.pickle"
    kernel.run(BEFORE)
    kernel.run("torch.cuda.reset_peak_memory_stats()\n"
               "torch.cuda.memory._record_memory_history(max_entries=100000)\n"
               f"{IN_THE_EXPERIMENT}\n"
               f"torch.cuda.memory._dump_snapshot({str(out)!r})\n"
               "torch.cuda.memory._record_memory_history(enabled=None)")
    true_peak = kernel.value("scope_peak")
    kernel.run(f"loaded = gpuexp.load_snapshot({str(out)!r})")
    (device,) = kernel.value("loaded.to_dict()")
    peak = device["peak"]
    bounds = peak.get("bounds") or {"at_least": peak["peak"]["bytes"], "at_most": peak["peak"]["bytes"]}
    print(f"torch's file: true peak {true_peak}, replayed {peak['peak']['bytes']}, bounds {bounds}, "
          f"{peak['completeness']['inferred_sizes']} sizes inferred")
    assert bounds["at_least"] <= true_peak <= bounds["at_most"], (true_peak, bounds)
    assert "true_peak" not in peak, "torch's own file carries no peak"


# A training loop whose memory grows a step at a time (each step keeps 4 MiB), so the peak falls
# in its last step, one recorded without stacks under the sampled default.
GROWING = model_and_optimizer(512) + """\
kept = []
def train(steps):
    for _ in range(steps):
        x = torch.randn(64, 512, device="cuda")
        model(x).square().mean().backward()
        kept.append(torch.empty(1 << 20, device="cuda"))  # the line that grows
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()"""


def train_traced(kernel, name, steps):
    kernel.run(f"exp = gpuexp.GPUExperiment({name!r}, trace=True)")
    kernel.run(f"train({steps})\nscope_peak = torch.cuda.max_memory_allocated()")
    scope_peak = kernel.value("scope_peak")
    kernel.run("exp.finish()")
    (device,) = kernel.value("exp.data.to_dict()")["trace"]
    return device["peak"], scope_peak, kernel.value("str(exp.data.trace)")


def test_a_training_loop_traced_with_sampled_stacks_peaks_at_torch_s_figure_and_says_it_was_sampled(kernel, tmp_path):
    kernel.run(GROWING)
    kernel.run("train(2)")  # CUDA, cuBLAS and Adam's state from before the experiment
    peak, scope_peak, text = train_traced(kernel, "sampled", 30)
    assert peak["peak"]["bytes"] == scope_peak == peak["true_peak"], peak["completeness"]
    assert rows_total(peak) == scope_peak, "the rows add up to the peak"
    sampling = peak["sampling"]
    print(f"sampled: peak {scope_peak} bytes, {sampling}")
    assert 2 <= sampling["with_stacks"] < sampling["steps"], sampling
    assert sampling["mapped_bytes"] > 0 and sampling["sites_from_steps"], sampling
    assert sampling["direct_bytes"] + sampling["mapped_bytes"] + sampling["unattributed_bytes"] == scope_peak
    assert "attribution sampled: Python stacks on" in text, text
    # Every step's kept block goes to its line, sampled or not: 30 of them.
    grown = [row for row in peak["sites"] if "kept.append" in (row["source"] or "")]
    assert len(grown) == 1 and grown[0]["bytes"] == 30 * 4 * (1 << 20), peak["sites"]
    out = tmp_path / "sampled.pickle"
    kernel.run(f"exp.data.save_snapshot({str(out)!r})\nloaded = gpuexp.load_snapshot({str(out)!r})")
    (loaded,) = kernel.value("loaded.to_dict()")
    assert loaded["peak"]["peak"]["bytes"] == scope_peak
    assert loaded["peak"]["sampling"]["mapped_bytes"] == sampling["mapped_bytes"], "the marks are saved with it"


def test_trace_sampling_off_records_stacks_on_every_step_and_says_the_trace_was_full(kernel):
    kernel.run(GROWING)
    kernel.run("train(2)\ngpuexp.config(trace_sampling=False)")
    peak, scope_peak, text = train_traced(kernel, "full", 12)
    assert peak["peak"]["bytes"] == scope_peak and rows_total(peak) == scope_peak
    sampling = peak["sampling"]
    assert sampling["with_stacks"] == sampling["steps"] and sampling["mapped_bytes"] == 0, sampling
    assert "attribution: full, Python stacks on all" in text, text
    # With no optimizer step at all, stacks stay on throughout and the report says so.
    kernel.run("gpuexp.config(trace_sampling=True)\nexp = gpuexp.GPUExperiment('inference', trace=True)\n"
               "with torch.no_grad():\n    y = model(torch.randn(64, 512, device='cuda'))\nexp.finish()")
    assert "attribution: full, Python stacks on every allocation" in kernel.value("str(exp.data.trace)")
