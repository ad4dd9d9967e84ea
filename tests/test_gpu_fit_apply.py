"""gpuexp.fit_apply.verify on an NVIDIA GPU (`pytest -m gpu`), in real kernels: checkpointing
lowers the measured peak of a hand-written transformer, a limit the step runs out of memory under
is met with it, and after every run the model, gradients, optimizer state, GradScaler and RNG are
exactly as they were, with no memory left behind."""

from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

BENCH = Path(__file__).resolve().parent.parent / "bench"

SETUP = f"""\
import sys, torch, gpuexp
sys.path.insert(0, {str(BENCH)!r})
import fit_models
from gpuexp.fit_apply import verify
torch.manual_seed(0)
model = fit_models.hand_written_transformer(torch, d_model=256, heads=4, layers=4, seq_len=256, vocab=4096).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cuda")
def step(bs):
    opt.zero_grad(set_to_none=True)
    tokens = torch.randint(0, 4096, (bs, 256), device="cuda")
    logits = model(tokens)  # the tokens were drawn from the CUDA RNG, which verify puts back too
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 4096), tokens.reshape(-1))
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
step(2)
model(torch.randint(0, 4096, (2, 256), device="cuda")).sum().backward()  # gradients exist before verify
state = dict(modules={{"model": model}}, optimizers={{"opt": opt}}, scalers={{"scaler": scaler}})
blocks = {{"kind": "checkpoint", "model": model, "paths": ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]}}
def fingerprint():
    def bits(t):
        t = t.detach().cpu().reshape(-1)
        return t.view(torch.int32 if t.element_size() == 4 else torch.int64).tolist()
    # Put back in place, at the same address; a gradient the step dropped comes back in new memory.
    in_place = [*model.parameters(), *model.buffers(),
                *(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)),
                scaler._scale, scaler._growth_tracker]
    grads = [p.grad for p in model.parameters()]
    return {{
        "tensors": [(id(t), t._version, t.data_ptr() if t.is_cuda else None, bits(t)) for t in in_place],
        "grads": [(id(t), t._version, bits(t)) for t in grads],
        "groups": [(id(g), dict((k, v) for k, v in g.items() if k != "params")) for g in opt.param_groups],
        "scaler": sorted((k, repr(v)) for k, v in vars(scaler).items() if not torch.is_tensor(v)),
        "rng": [torch.get_rng_state().tolist(), [s.tolist() for s in torch.cuda.get_rng_state_all()]],
        "training": [m.training for m in model.modules()],
    }}
def allocated_now():
    # cuBLAS's workspaces aside: torch keeps one per thread that ran a matmul, remade on demand.
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    return torch.cuda.memory_allocated()
before = fingerprint()
allocated = allocated_now()
"""


def test_checkpointing_lowers_the_measured_peak_and_every_piece_of_state_comes_back(kernel):
    kernel.run(SETUP)
    kernel.run("plain = verify(step, 16, 'as_is', time_forwards=(model, blocks['paths']), **state)\n"
               "checked = verify(step, 16, blocks, **state)")
    plain, checked = kernel.value("[plain.to_dict(), checked.to_dict()]")
    assert plain["out_of_memory"] is None and checked["out_of_memory"] is None
    # The blocks' forwards, timed in one more run: each took GPU time, all of them less than the step.
    forwards = plain["forward_seconds"]
    assert list(forwards) == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"], forwards
    assert all(seconds > 0 for seconds in forwards.values()), forwards
    assert sum(forwards.values()) < plain["seconds"], (forwards, plain)
    assert checked["forward_seconds"] is None
    assert checked["peak"] < 0.8 * plain["peak"], (plain, checked)
    assert checked["option"] == "checkpoint blocks.0, blocks.1, blocks.2, blocks.3"
    assert plain["seconds"] > 0 and checked["seconds"] > 0
    assert plain["leftover"] == 0 and checked["leftover"] == 0, (plain, checked)
    assert kernel.value("allocated_now() == allocated") is True
    assert kernel.value("fingerprint() == before") is True
    # No wrapper left behind, and the model trains on.
    assert kernel.value("any('forward' in m.__dict__ for m in model.modules())") is False
    kernel.run("step(4)")
    assert kernel.value("fingerprint()['tensors'] != before['tensors']") is True  # it trained


def test_under_a_limit_the_plain_step_runs_out_and_the_checkpointed_one_fits(kernel):
    kernel.run(SETUP)
    kernel.run("plain = verify(step, 32, 'as_is', **state)\nchecked = verify(step, 32, blocks, **state)\n"
               "limit = allocated + (plain.peak + checked.peak) // 2\n"
               "out = verify(step, 32, 'as_is', limit=limit, repeat=1, **state)\n"
               "fits = verify(step, 32, blocks, limit=limit, repeat=1, **state)")
    assert kernel.value("out.out_of_memory is not None and 'out of memory' in out.out_of_memory.lower()") is True
    assert kernel.value("fits.out_of_memory") is None
    assert kernel.value("[out.leftover, fits.leftover]") == [0, 0]
    assert kernel.value("fingerprint() == before") is True
    assert kernel.value("allocated_now() == allocated") is True


def test_autocast_runs_the_step_in_bfloat16_and_restores_it_all(kernel):
    kernel.run(SETUP)
    kernel.run("plain = verify(step, 16, 'as_is', **state)\nhalf = verify(step, 16, 'autocast', **state)")
    assert kernel.value("half.option") == "autocast bfloat16"
    assert kernel.value("half.peak < plain.peak") is True
    assert kernel.value("fingerprint() == before") is True
    assert kernel.value("[half.leftover, allocated_now() == allocated]") == [0, True]


def test_a_step_that_raises_is_restored_and_the_error_is_the_users(kernel):
    kernel.run(SETUP + "def broken(bs):\n    step(bs)\n    raise KeyError('after the step')")
    failed = kernel.run("verify(broken, 8, blocks, **state)", expect_error=True)
    assert failed.error.startswith("KeyError"), failed.error
    assert kernel.value("fingerprint() == before") is True
    assert kernel.value("any('forward' in m.__dict__ for m in model.modules())") is False
