"""gpuexp.fit on an NVIDIA GPU (`pytest -m gpu`), in real kernels: a transformer that runs out of
memory under a limit fits with the checkpointing plan in a real step, verify=True shows the
prediction next to the measurement, nothing is allocated or changed, and the finder says which
option raises its answer."""

import pytest

from test_fit import TRANSFORMER
from test_gpu_estimate import RNN

pytestmark = pytest.mark.gpu

# The notebook's transformer, larger, on the GPU, under a limit its step at 64 does not fit.
ON_GPU = TRANSFORMER.replace("LM()", "LM(vocab=8000, d=512, layers=8).cuda()").replace(
    "torch.randint(0, 1000, (bs, 64))", "torch.randint(0, 8000, (bs, 256), device='cuda')"
).replace("estimated = gpuexp.estimate(lm_step, 32)", "estimated = gpuexp.estimate(lm_step, 64)")


def test_the_checkpointing_plan_makes_a_step_that_ran_out_of_memory_fit_in_a_real_run(kernel):
    kernel.run(ON_GPU + "found = gpuexp.fit(lm_step, 64, limit=limit, verify='checkpoint')\nreport = found.to_dict()")
    report = kernel.value("report")
    assert report["fits"] is False
    checkpoint = next(o for o in report["options"] if o["option"] == "checkpoint")
    assert checkpoint["fits"] is True, checkpoint
    verified = report["verified"]
    assert verified["option"] == "checkpoint" and verified["error"] is None, verified
    # Within 5% of the measured peak, and under the budget for real.
    assert abs(verified["measured_peak"] - verified["predicted_peak"]) <= 0.05 * verified["measured_peak"], verified
    assert verified["measured_peak"] <= report["budget"]["bytes"]
    # The recompute time predicted within 25% of the measured cost.
    recompute = verified["seconds"] - verified["baseline_seconds"]
    predicted = verified["predicted_seconds"] - verified["baseline_seconds"]
    assert abs(recompute - predicted) <= 0.25 * recompute, verified
    text = kernel.run("print(found)").text
    assert "verified: activation checkpointing in one real step" in text, text
    if verified["widened"] is not None:  # the first plan's real step ran out through fragmentation
        assert verified["widened"]["stranded"] > 0, verified
        assert set(verified["widened"]["paths"]) < set(verified["paths"]), verified
        assert "fit widened it to save that much more" in text, text


def test_fit_allocates_nothing_and_leaves_the_model_as_it_was(kernel):
    kernel.run(
        ON_GPU + "def fingerprint():\n"
        "    return [p.detach().cpu().clone() for p in lm.parameters()] + "
        "[v.cpu().clone() for s in lm_opt.state.values() for v in s.values()]\n"
        "before = fingerprint()\nrng = (torch.get_rng_state(), torch.cuda.get_rng_state())\n"
        "torch.cuda.reset_peak_memory_stats()\nallocated = torch.cuda.memory_allocated()\n"
        "gpuexp.fit(lm_step, 64, limit=limit)\n"
        "grew = torch.cuda.max_memory_allocated() - allocated"
    )
    assert kernel.value("grew") == 0
    assert kernel.value("all(torch.equal(a, b) for a, b in zip(before, fingerprint()))") is True
    assert kernel.value("torch.equal(rng[0], torch.get_rng_state()) and "
                        "torch.equal(rng[1], torch.cuda.get_rng_state())") is True


def test_the_finder_says_which_option_raises_its_answer(kernel):
    kernel.run(ON_GPU + "result = gpuexp.find_batch_size(lm_step, start=4, max=256, limit=limit, progress=False, "
               "want=128)")
    answer = kernel.value("result.batch_size")
    assert answer is not None and answer < 128
    text = kernel.run("print(result)").text
    assert "hint: to reach 128, gpuexp.fit(step, 128) says: " in text, text


def test_a_cudnn_rnn_is_refused_by_name_and_allocates_nothing(kernel):
    """fit runs its estimates as estimate does: a step on cuDNN's RNN can't run under fake
    tensors, and fit says so by name, with nothing allocated and no fake left in the layer."""
    assert "gpuexp.estimate(step, batch_size)" in RNN
    kernel.run(RNN.replace("gpuexp.estimate(step, batch_size)", "gpuexp.fit(step, batch_size)"))
    error, moved, fakes = kernel.value("rnn_step('LSTM', 64)")
    assert error is not None and "nn.LSTM runs on cuDNN (aten._cudnn_rnn)" in error, error
    assert moved == 0 and fakes == 0, (moved, fakes)
