"""Batch-size finders side by side: gpuexp.find_batch_size (from its estimate, and by trials
alone), the true max, Lightning and accelerate.

The batch size each finds, under the same memory limit, against the true maximum.

    CUDA_VISIBLE_DEVICES=0 python bench/batch_size.py [--limit 24GiB] [--max 8192] [--json PATH]
                                                      [--quick] [--models conv,transformer]
                                                      [--tools true-max,gpuexp,gpuexp-trials,lightning,accelerate]
    python bench/batch_size.py --cpu-smoke

Run on a GPU machine (torch with CUDA and gpuexp installed; lightning and accelerate are
optional: a tool that cannot run is reported as unavailable and the bench goes on). Two models
built in plain torch, nothing downloaded: a ResNet-ish conv net on 3x128x128 images with 10
classes, and a small transformer LM (d_model 512, 6 layers, seq_len 256, vocab 8192) whose step
takes (batch, seq_len) tokens with only the batch varying. A step is one real training step:
random inputs built on the GPU, forward, loss, backward, AdamW step, zero_grad, then
torch.cuda.synchronize() so an out-of-memory error surfaces inside the trial. Each tool gets a
fresh model and optimizer (created once for its whole run, so optimizer state exists as in real
training) and runs with torch's allocations capped at --limit
(torch.cuda.set_per_process_memory_fraction(limit / total), restored afterwards):

- true max: bisection between 1 and --max; a size fits only if 2 consecutive steps succeed; every
  failure drops the exception's frames, then gc.collect() and torch.cuda.empty_cache();
- gpuexp.find_batch_size(step, start=8, max=--max, limit=--limit): it estimates the step's peak
  under fake tensors at a few sizes, then runs one real trial a little below the predicted size
  and one at the size that trial's measured peak corrects to;
- the same with estimate=False: today's predict-and-verify mode, by real trials alone (two
  probes, a linearity check, the prediction verified twice);
- Lightning: Tuner(trainer).scale_batch_size(mode="binsearch", init_val=8, max_trials=25,
  steps_per_trial=1) on a LightningModule wrapping the same model and step;
- accelerate: find_executable_batch_size(starting_batch_size=min(--max, 4096)), which shrinks the
  size by 10% per OOM; the decorated function is a short training loop of
  --accelerate-steps steps (default 2, so the optimizer state exists during a forward pass).

Each tool's answer is then re-run for 3 steps under the limit (the tool's own model and
optimizer; for Lightning, a fresh pair, as Lightning restores its checkpoint after the search).
"sizes tried" counts the trials, each at one batch size (the issue's "step trials"); "step calls"
counts calls of the step (training_step for Lightning), failed ones included. A gpuexp trial runs
the step twice in a row, Lightning's once (steps_per_trial=1), accelerate's --accelerate-steps
times, the true max's twice.
gpuexp's targets (from the estimate): at least 97% of the true max, no OOM on the 3 re-runs, at
most 2 sizes tried.

Exit status: 0 when gpuexp meets every target, 1 when not, 2 when it cannot be measured here
(no CUDA GPU, gpuexp not installed). --cpu-smoke builds each model and runs two training steps at
batch size 2 on the CPU (no search, no GPU needed) and exits 0 when they work.
"""

import argparse
import contextlib
import gc
import inspect
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
import warnings

TARGET_SHARE = 0.97
TARGET_TRIALS = 2
RERUNS = 3
LEARNING_RATE = 1e-4
GPUEXP_START = 8
LIGHTNING_INIT = 8
LIGHTNING_MAX_TRIALS = 25
ACCELERATE_START_CAP = 4096
TOOLS = ("true-max", "gpuexp", "gpuexp-trials", "lightning", "accelerate")
LABELS = {
    "true-max": "true max (bisection, 2 steps per size)",
    "gpuexp": "gpuexp.find_batch_size (from the estimate)",
    "gpuexp-trials": "gpuexp.find_batch_size(estimate=False)",
    "lightning": "Lightning Tuner.scale_batch_size (binsearch)",
    "accelerate": "accelerate find_executable_batch_size",
}

# Model settings: (default, --quick).
CONV = {
    False: dict(width=64, blocks=(2, 2, 2, 2), image=128, classes=10),
    True: dict(width=32, blocks=(1, 1, 1, 1), image=128, classes=10),
}
TRANSFORMER = {
    False: dict(d_model=512, layers=6, heads=8, seq_len=256, vocab=8192),
    True: dict(d_model=256, layers=2, heads=4, seq_len=128, vocab=4096),
}
DEFAULT_LIMIT = {False: "24GiB", True: "4GiB"}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", help="memory cap for every tool, e.g. 24GiB (default 24GiB; 4GiB with --quick)")
    parser.add_argument("--max", type=int, default=8192, help="largest batch size any tool may try (default 8192)")
    parser.add_argument("--json", metavar="PATH", help="also write every figure as JSON to PATH")
    parser.add_argument("--quick", action="store_true", help="smaller models and a 4GiB limit, for a fast run")
    parser.add_argument("--models", default="conv,transformer",
                        help="comma-separated: conv, transformer (default both)")
    parser.add_argument("--tools", default=",".join(TOOLS),
                        help=f"comma-separated subset of {', '.join(TOOLS)} (default all)")
    parser.add_argument("--accelerate-steps", type=int, default=2,
                        help="training steps inside accelerate's decorated function (default 2)")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="build each model and run 2 training steps at batch size 2 on the CPU; no search")
    args = parser.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    if not args.models or any(m not in ("conv", "transformer") for m in args.models):
        parser.error(f"--models {','.join(args.models)!r}: pick from conv, transformer")
    if not args.tools or any(t not in TOOLS for t in args.tools):
        parser.error(f"--tools {','.join(args.tools)!r}: pick from {', '.join(TOOLS)}")
    if args.max < 1:
        parser.error("--max must be at least 1")
    if args.accelerate_steps < 1:
        parser.error("--accelerate-steps must be at least 1")
    if args.limit is None:
        args.limit = DEFAULT_LIMIT[args.quick]
    try:
        args.limit_bytes = parse_size(args.limit)
    except ValueError as why:
        parser.error(f"--limit: {why}")
    return args


def parse_size(text):
    """Bytes from "24GiB", "512MiB" or a number, with the units gpuexp accepts (powers of 1024)."""
    text = str(text).strip()
    split = len(text)
    for i, ch in enumerate(text):
        if not (ch.isdigit() or ch == "."):
            split = i
            break
    number, unit = text[:split], text[split:].strip().lower()
    scales = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
              "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}
    try:
        value = float(number) * scales[unit]
    except (ValueError, KeyError):
        raise ValueError(f"{text!r} is not a memory size: write it like 24GiB, 512MiB or a number of bytes") from None
    if value < 1:
        raise ValueError(f"{text!r} is not a memory size above zero")
    return int(value)


def gib(n):
    return f"{n / 2**30:.2f} GiB"


def fail(message):
    print(f"batch_size: {message}", file=sys.stderr)
    return 2


# ---- the two models and their steps ------------------------------------------------------


class Workload:
    """A model family: how to build it, make a random batch of a size on a device, and get its loss."""

    def __init__(self, name, title, build, batch, loss):
        self.name, self.title, self.build, self.batch, self.loss = name, title, build, batch, loss


def make_workloads(torch, quick):
    nn = torch.nn
    F = torch.nn.functional

    class Block(nn.Module):
        """A ResNet basic block: two 3x3 Conv/BatchNorm with ReLU and a skip connection."""

        def __init__(self, cin, cout, stride):
            super().__init__()
            self.body = nn.Sequential(
                nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout),
            )
            self.skip = (nn.Identity() if stride == 1 and cin == cout
                         else nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)))

        def forward(self, x):
            return F.relu(self.body(x) + self.skip(x))

    conv = CONV[quick]

    def build_conv():
        w = conv["width"]
        layers = [nn.Conv2d(3, w, 3, 2, 1, bias=False), nn.BatchNorm2d(w), nn.ReLU(inplace=True)]
        cin = w
        for stage, count in enumerate(conv["blocks"]):
            cout = w * 2**stage
            for i in range(count):
                layers.append(Block(cin, cout, 2 if (i == 0 and stage > 0) else 1))
                cin = cout
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, conv["classes"])]
        return nn.Sequential(*layers)

    def conv_batch(batch_size, device):
        x = torch.randn(batch_size, 3, conv["image"], conv["image"], device=device)
        y = torch.randint(0, conv["classes"], (batch_size,), device=device)
        return x, y

    def conv_loss(model, x, y):
        return F.cross_entropy(model(x), y)

    tf = TRANSFORMER[quick]

    class TinyLM(nn.Module):
        """Token embedding + learned positions, a pre-norm TransformerEncoder and an LM head."""

        def __init__(self):
            super().__init__()
            d = tf["d_model"]
            self.embed = nn.Embedding(tf["vocab"], d)
            self.position = nn.Parameter(torch.zeros(1, tf["seq_len"], d))
            layer = nn.TransformerEncoderLayer(d, tf["heads"], dim_feedforward=4 * d, dropout=0.1,
                                               batch_first=True, norm_first=True)
            self.encoder = nn.TransformerEncoder(layer, tf["layers"], enable_nested_tensor=False)
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, tf["vocab"])

        def forward(self, tokens):
            h = self.embed(tokens) + self.position[:, : tokens.shape[1]]
            return self.head(self.norm(self.encoder(h)))

    def tf_batch(batch_size, device):
        tokens = torch.randint(0, tf["vocab"], (batch_size, tf["seq_len"]), device=device)
        targets = torch.randint(0, tf["vocab"], (batch_size, tf["seq_len"]), device=device)
        return tokens, targets

    def tf_loss(model, tokens, targets):
        logits = model(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    blocks = "-".join(str(b) for b in conv["blocks"])
    return {
        "conv": Workload(
            "conv",
            f"ResNet-ish conv net (width {conv['width']}, blocks {blocks}), 3x{conv['image']}x{conv['image']} "
            f"images, {conv['classes']} classes",
            build_conv, conv_batch, conv_loss),
        "transformer": Workload(
            "transformer",
            f"TransformerEncoder LM (d_model {tf['d_model']}, {tf['layers']} layers, {tf['heads']} heads, "
            f"seq_len {tf['seq_len']}, vocab {tf['vocab']})",
            TinyLM, tf_batch, tf_loss),
    }


def fresh(torch, workload, device):
    """A new model and AdamW optimizer on the device, the same initial weights every time."""
    torch.manual_seed(0)
    model = workload.build().to(device)
    model.train()
    return model, torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)


def make_step(torch, model, optimizer, workload, device):
    """step(batch_size): one real training step with random inputs built on the device."""
    cuda = device.type == "cuda"

    def step(batch_size):
        # A no-op after a step that finished; after one that ran out of memory mid-backward it drops
        # the partial gradients, so they don't sit in memory during the next forward pass.
        optimizer.zero_grad(set_to_none=True)
        inputs, targets = workload.batch(batch_size, device)
        loss = workload.loss(model, inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)

    return step


# ---- running steps under the limit -------------------------------------------------------


def is_oom(error):
    """torch.OutOfMemoryError, or a RuntimeError carrying CUDA's out-of-memory message."""
    if not isinstance(error, RuntimeError):
        return False
    text = str(error)
    return (type(error).__name__ == "OutOfMemoryError" or "out of memory" in text
            or "CUBLAS_STATUS_ALLOC_FAILED" in text)


def release(torch):
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def attempt(torch, step, batch_size):
    """True if step(batch_size) ran; False if it ran out of memory, after a full cleanup: the
    exception's frames (which hold the failed step's tensors) are cleared, then gc and empty_cache."""
    try:
        step(batch_size)
        return True
    except Exception as error:
        if not is_oom(error):
            raise
        traceback.clear_frames(error.__traceback__)
        error.__traceback__ = None
        error.__context__ = None
        del error
    release(torch)
    return False


@contextlib.contextmanager
def memory_limit(torch, limit_bytes, index):
    """Caps torch's allocations at limit_bytes on the GPU, as gpuexp does with limit=; restores the
    previous fraction afterwards."""
    memory = torch.cuda.memory
    get_fraction = getattr(memory, "get_per_process_memory_fraction", None)
    before = get_fraction(index) if get_fraction is not None else 1.0
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(limit_bytes / total, index)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(before, index)


def rerun(torch, step, batch_size, record):
    """Runs the found size RERUNS times; records how many ran out of memory."""
    if not batch_size:
        return
    ooms = 0
    for _ in range(RERUNS):
        if not attempt(torch, step, batch_size):
            ooms += 1
    record["rerun_ooms"] = ooms
    record["rerun_runs"] = RERUNS
    print(f"  re-run of batch size {batch_size}: {ooms} of {RERUNS} steps ran out of memory", flush=True)


def synced_clock(torch):
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


def new_record(tool):
    return {"tool": tool, "label": LABELS[tool], "status": "ok", "reason": None, "batch_size": None,
            "sizes_tried": None, "step_calls": None, "wall_s": None, "rerun_ooms": None, "rerun_runs": None,
            "trials": []}


# ---- the tools ---------------------------------------------------------------------------


def run_true_max(torch, workload, device, args):
    record = new_record("true-max")
    model, optimizer = fresh(torch, workload, device)
    step = make_step(torch, model, optimizer, workload, device)
    lo, hi = 0, args.max + 1  # lo is known to fit (0 trivially), hi known not to
    calls = 0
    started = synced_clock(torch)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        t0 = time.perf_counter()
        fits = True
        for _ in range(2):
            calls += 1
            if not attempt(torch, step, mid):
                fits = False
                break
        seconds = time.perf_counter() - t0
        record["trials"].append({"batch_size": mid, "fits": fits, "seconds": round(seconds, 4)})
        outcome = "fits (2 steps)" if fits else "out of memory"
        print(f"  true max: batch size {mid}: {outcome}, {seconds:.2f} s", flush=True)
        if fits:
            lo = mid
        else:
            hi = mid
    record["wall_s"] = synced_clock(torch) - started
    record["batch_size"] = lo
    record["step_calls"] = calls
    record["sizes_tried"] = len(record["trials"])
    rerun(torch, step, lo, record)
    del step, model, optimizer
    return record


def run_gpuexp(torch, workload, device, args, gpuexp, estimate=True):
    record = new_record("gpuexp" if estimate else "gpuexp-trials")
    model, optimizer = fresh(torch, workload, device)
    step = make_step(torch, model, optimizer, workload, device)
    calls = {"steps": 0}

    def counted_step(batch_size):
        calls["steps"] += 1
        step(batch_size)  # noqa: F821 (ruff misreads the `del step` after the search, which frees the model)

    started = synced_clock(torch)
    try:
        result = gpuexp.find_batch_size(counted_step, start=GPUEXP_START, max=args.max, limit=args.limit,
                                        estimate=estimate)
    except Exception as why:
        record.update(status="error", reason=f"{type(why).__name__}: {why}")
        print(f"  gpuexp failed: {record['reason']}", flush=True)
        return record
    finally:
        record["wall_s"] = synced_clock(torch) - started
    record["batch_size"] = result.batch_size
    record["sizes_tried"] = result.trials
    record["step_calls"] = calls["steps"]
    record["verdict"] = result.verdict
    try:
        record["result"] = result.to_dict()
    except Exception as why:  # the figures above are what matter
        record["result"] = f"to_dict failed: {why}"
    print(str(result), flush=True)
    if device.type == "cuda":  # gpuexp restored the fraction it found; the re-run stays under the limit
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(args.limit_bytes / total, device)
    rerun(torch, step, result.batch_size, record)
    del step, counted_step, model, optimizer, result
    return record


def run_lightning(torch, workload, device, args):
    """Lightning's tuner in binsearch mode, on a LightningModule wrapping the same model and step."""
    record = new_record("lightning")
    try:
        try:
            import lightning.pytorch as pl
            from lightning.pytorch.tuner import Tuner
        except ImportError:
            import pytorch_lightning as pl
            from pytorch_lightning.tuner import Tuner
    except Exception as why:
        record.update(status="unavailable", reason=f"cannot import lightning ({type(why).__name__}: {why})")
        print(f"  Lightning unavailable: {record['reason']}", flush=True)
        return record
    record["version"] = getattr(pl, "__version__", "?")
    root = tempfile.mkdtemp(prefix="bench-lightning-")
    try:
        found, trials, wall, notes = _lightning_search(torch, pl, Tuner, workload, device, args, root)
    except Exception as why:
        record.update(status="unavailable", reason=f"{type(why).__name__}: {why}")
        record["traceback"] = traceback.format_exc()
        print(f"  Lightning unavailable: {record['reason']}", flush=True)
        release(torch)
        return record
    finally:
        shutil.rmtree(root, ignore_errors=True)
    record["wall_s"] = wall
    record["batch_size"] = found
    record["sizes_tried"] = record["step_calls"] = len(trials)
    record["trials"] = [{"batch_size": b, "fits": ok} for b, ok in trials]
    record["largest_that_ran"] = max((b for b, ok in trials if ok), default=None)
    record.update(notes)
    release(torch)
    record["left_allocated_bytes"] = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    # Lightning restores the checkpoint it saved before the search (initial weights, no optimizer
    # state): a fresh model and optimizer are the same thing.
    model, optimizer = fresh(torch, workload, device)
    step = make_step(torch, model, optimizer, workload, device)
    rerun(torch, step, found, record)
    del step, model, optimizer
    return record


def _lightning_search(torch, pl, Tuner, workload, device, args, root):
    cuda = device.type == "cuda"
    # The tuner stops growing once the batch size reaches the dataset's length: make it longer
    # than any size it may try. Items are indices; the inputs are built on the device.
    length = 2 * max(args.max, LIGHTNING_INIT) + 1

    class Indices(torch.utils.data.Dataset):
        def __len__(self):
            return length

        def __getitem__(self, i):
            return i

    class Probe(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = workload.build()
            self.batch_size = LIGHTNING_INIT
            self.calls = []  # [batch size, ran] per training_step call

        def train_dataloader(self):
            return torch.utils.data.DataLoader(Indices(), batch_size=self.batch_size, shuffle=False, num_workers=0)

        def training_step(self, batch, batch_idx):
            size = int(batch.shape[0])
            self.calls.append([size, False])
            inputs, targets = workload.batch(size, self.device)
            return workload.loss(self.net, inputs, targets)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if cuda:
                torch.cuda.synchronize(self.device)
            self.calls[-1][1] = True

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LEARNING_RATE)

    module = Probe()
    trainer = pl.Trainer(
        accelerator="gpu" if cuda else "cpu", devices=[device.index or 0] if cuda else 1, max_steps=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, benchmark=False, default_root_dir=root,
    )
    tuner = Tuner(trainer)
    options = dict(mode="binsearch", init_val=LIGHTNING_INIT, max_trials=LIGHTNING_MAX_TRIALS, steps_per_trial=1)
    accepted = inspect.signature(tuner.scale_batch_size).parameters
    notes = {}
    if "max_val" in accepted:  # lightning >= 2.5.x; its default is 8192
        options["max_val"] = args.max
    notes["margin"] = accepted["margin"].default if "margin" in accepted else 0.0
    notes["options"] = {k: v for k, v in options.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*smaller than the logging interval.*")
        started = synced_clock(torch)
        found = tuner.scale_batch_size(module, **options)
        wall = synced_clock(torch) - started
    trials = [tuple(c) for c in module.calls]
    del tuner, trainer, module
    gc.collect()
    return found, trials, wall, notes


def run_accelerate(torch, workload, device, args):
    record = new_record("accelerate")
    try:
        import accelerate
        from accelerate.utils import find_executable_batch_size
        record["version"] = accelerate.__version__
    except Exception as why:
        record.update(status="unavailable", reason=f"cannot import accelerate ({type(why).__name__}: {why})")
        print(f"  accelerate unavailable: {record['reason']}", flush=True)
        return record
    start = min(args.max, ACCELERATE_START_CAP)
    record["starting_batch_size"] = start
    record["steps_per_call"] = args.accelerate_steps
    model, optimizer = fresh(torch, workload, device)
    step = make_step(torch, model, optimizer, workload, device)
    counts = {"steps": 0}
    trials = record["trials"]

    # The decorated function is what a user writes: a training loop taking the batch size first.
    @find_executable_batch_size(starting_batch_size=start)
    def train(batch_size):
        trials.append({"batch_size": batch_size, "fits": False})
        for _ in range(args.accelerate_steps):
            counts["steps"] += 1
            step(batch_size)  # noqa: F821 (ruff misreads the `del step` at the end)
        trials[-1]["fits"] = True
        return batch_size

    started = synced_clock(torch)
    try:
        found = train()
    except Exception as why:
        record.update(status="unavailable", reason=f"{type(why).__name__}: {why}")
        print(f"  accelerate unavailable: {record['reason']}", flush=True)
        release(torch)
        return record
    finally:
        record["wall_s"] = synced_clock(torch) - started
    record["batch_size"] = found
    record["step_calls"] = counts["steps"]
    record["sizes_tried"] = len(trials)
    print(f"  accelerate: {len(trials)} sizes, {counts['steps']} steps, found {found}", flush=True)
    rerun(torch, step, found, record)
    del step, model, optimizer, train
    return record


# ---- report ------------------------------------------------------------------------------


def table(workload_result):
    tools = workload_result["tools"]
    true = tools.get("true-max", {}).get("batch_size")
    rows = ["| tool | batch size found | % of true max | sizes tried | step calls | wall s | OOMs on re-run |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for tool in TOOLS:
        r = tools.get(tool)
        if r is None:
            continue
        if r["status"] != "ok":
            reason = (r["reason"] or "").splitlines()[0] if r["reason"] else ""
            reason = reason if len(reason) <= 160 else reason[:157] + "..."
            rows.append(f"| {r['label']} | {r['status']}: {reason.replace('|', '/')} | | | | | |")
            continue
        size = r["batch_size"]
        share = f"{100 * size / true:.1f}%" if (true and size is not None) else "n/a"
        reruns = f"{r['rerun_ooms']}/{r['rerun_runs']}" if r["rerun_runs"] else "n/a"
        wall = f"{r['wall_s']:.2f}" if r["wall_s"] is not None else "n/a"
        found = size if size is not None else "none"
        rows.append(f"| {r['label']} | {found} | {share} | {r['sizes_tried']} | {r['step_calls']} | {wall} "
                    f"| {reruns} |")
    return "\n".join(rows)


def notes(workload_result):
    """What a reader needs to read the table: how each tool's figures were made."""
    tools = workload_result["tools"]
    lines = []
    t = tools.get("true-max")
    if t and t["status"] == "ok":
        lines.append(f"- true max: {t['sizes_tried']} sizes tried; a size fits only if 2 steps in a row run at it.")
    for tool in ("gpuexp", "gpuexp-trials"):
        g = tools.get(tool)
        if g and g["status"] == "ok":
            lines.append(f"- {LABELS[tool]}: {g.get('verdict')}")
    lt = tools.get("lightning")
    if lt and lt["status"] == "ok":
        lines.append(f"- Lightning {lt.get('version')}: the largest size that ran was {lt.get('largest_that_ran')}; it "
                     f"returns the last size that ran less its margin ({lt.get('margin', 0):.0%}); one training_step "
                     "per trial; the time includes its checkpoint save and restore.")
    a = tools.get("accelerate")
    if a and a["status"] == "ok":
        lines.append(f"- accelerate {a.get('version')}: started at {a.get('starting_batch_size')}, "
                     f"{a.get('sizes_tried')} calls of a {a.get('steps_per_call')}-step training loop.")
    if any(r.get("rerun_runs") for r in tools.values()):
        lines.append(f"- re-run: {RERUNS} steps at the size found, under the same limit.")
    return lines + ([""] if lines else [])


def checks(workload_result):
    """gpuexp's targets, each a dict with ok and a line."""
    tools = workload_result["tools"]
    g = tools.get("gpuexp")
    true = tools.get("true-max", {}).get("batch_size")
    name = workload_result["name"]
    out = []
    if g is None:
        return out
    if g["status"] != "ok" or g["batch_size"] is None:
        why = g["reason"] or "found no batch size"
        line = f"FAIL {name}: gpuexp.find_batch_size did not give an answer ({why})"
        return [{"target": "runs", "ok": False, "line": line}]
    size = g["batch_size"]
    if true:
        share = size / true
        ok = share >= TARGET_SHARE
        out.append({"target": "share_of_true_max", "ok": ok, "value": share,
                    "line": f"{'PASS' if ok else 'FAIL'} {name}: gpuexp finds >= {TARGET_SHARE:.0%} of the true max "
                            f"({size} of {true} = {share:.1%})"})
    else:
        out.append({"target": "share_of_true_max", "ok": None,
                    "line": f"SKIP {name}: no true max to compare with (run the true-max tool)"})
    ok = g["rerun_ooms"] == 0
    out.append({"target": "no_oom_on_rerun", "ok": ok, "value": g["rerun_ooms"],
                "line": f"{'PASS' if ok else 'FAIL'} {name}: gpuexp's size never OOMs on {RERUNS} re-runs "
                        f"({g['rerun_ooms']} of {g['rerun_runs']} did)"})
    ok = g["sizes_tried"] <= TARGET_TRIALS
    out.append({"target": "sizes_tried", "ok": ok, "value": g["sizes_tried"],
                "line": f"{'PASS' if ok else 'FAIL'} {name}: gpuexp tries <= {TARGET_TRIALS} sizes "
                        f"({g['sizes_tried']}, {g['step_calls']} step calls)"})
    return out


def cudnn_version(torch):
    try:
        return torch.backends.cudnn.version()
    except Exception:
        return None


def versions():
    found = {}
    for name in ("gpuexp", "lightning", "pytorch_lightning", "accelerate"):
        try:
            from importlib import metadata
            found[name] = metadata.version(name)
        except Exception:
            found[name] = None
    return found


# ---- CPU smoke ---------------------------------------------------------------------------


def cpu_smoke(torch, args):
    """Builds each model (default and --quick sizes) and runs 2 training steps at batch size 2 on the
    CPU; prints the parameters and what autograd saves per sample, for a rough max-batch guess."""
    device = torch.device("cpu")
    ok = True
    for quick in (False, True):
        for name, workload in make_workloads(torch, quick).items():
            if name not in args.models:
                continue
            tag = f"{name}{' (--quick)' if quick else ''}"
            try:
                model, optimizer = fresh(torch, workload, device)
                params = sum(p.numel() for p in model.parameters())
                step = make_step(torch, model, optimizer, workload, device)
                started = time.perf_counter()
                step(2)
                step(2)
                seconds = (time.perf_counter() - started) / 2
                state = sum(len(s) for s in optimizer.state.values())
                saved = saved_bytes_per_sample(torch, model, workload, device)
                limit = parse_size(DEFAULT_LIMIT[quick])
                guess = int((0.95 * limit - 16 * params) / saved) if saved else None
                with torch.no_grad():
                    loss = float(workload.loss(model, *workload.batch(2, device)))
                finite = loss == loss and abs(loss) != float("inf")
                ok &= finite and state > 0
                print(f"cpu-smoke {tag}: {workload.title}\n"
                      f"  {params / 1e6:.2f} M parameters, loss {loss:.3f}, AdamW state tensors {state}, "
                      f"{seconds:.2f} s per step at batch size 2 on the CPU\n"
                      f"  autograd saves about {saved / 2**20:.1f} MiB per sample; a rough guess of the max batch "
                      f"size under {DEFAULT_LIMIT[quick]}: {guess}", flush=True)
            except Exception:
                ok = False
                print(f"cpu-smoke {tag}: FAILED\n{traceback.format_exc()}", flush=True)
    print("cpu-smoke: " + ("models and steps work" if ok else "FAILED"))
    return 0 if ok else 1


def saved_bytes_per_sample(torch, model, workload, device):
    """Bytes of the tensors autograd saves for backward, per sample, from a forward pass at 2 and 4."""
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def measure(batch_size):
        seen = {}

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in param_storages:
                seen[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = workload.loss(model, *workload.batch(batch_size, device))
        del loss
        return sum(seen.values())

    return (measure(4) - measure(2)) / 2


# ---- main --------------------------------------------------------------------------------


def main(argv=None):
    args = parse_args(argv)
    try:
        import torch
    except ImportError as why:
        return fail(f"torch is not importable ({why}); run this on the GPU machine")
    if args.cpu_smoke:
        return cpu_smoke(torch, args)
    if not torch.cuda.is_available():
        return fail(
            "no CUDA GPU: torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}). "
            "This bench searches batch sizes against a GPU's memory; run it on the GPU machine "
            "(or try --cpu-smoke here to check that the models build and train)."
        )
    try:
        import gpuexp
    except ImportError as why:
        return fail(f"gpuexp is not importable ({why}); install its wheel first (make build / make gpu-wheel)")

    index = torch.cuda.current_device()
    device = torch.device("cuda", index)
    props = torch.cuda.get_device_properties(index)
    if args.limit_bytes > props.total_memory:
        return fail(f"--limit {args.limit} is more than the GPU's {gib(props.total_memory)}")
    torch.backends.cudnn.benchmark = False
    torch.set_float32_matmul_precision("high")  # TF32 matmuls, the same for every tool

    machine = {
        "gpu": torch.cuda.get_device_name(index),
        "gpu_total_bytes": props.total_memory,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": cudnn_version(torch),
        "python": platform.python_version(),
        "host": platform.node(),
        "versions": versions(),
    }
    print(f"# Batch-size finders side by side\n\n"
          f"Machine: {machine['gpu']} ({gib(props.total_memory)}), torch {machine['torch']} "
          f"(CUDA {machine['cuda']}), Python {machine['python']}, gpuexp {machine['versions']['gpuexp']}, "
          f"lightning {machine['versions']['lightning'] or machine['versions']['pytorch_lightning']}, "
          f"accelerate {machine['versions']['accelerate']}.\n"
          f"Limit {args.limit} ({args.limit_bytes} bytes, fraction {args.limit_bytes / props.total_memory:.4f} "
          f"of the GPU) for every tool; --max {args.max}{'; --quick' if args.quick else ''}.\n", flush=True)

    results = {"machine": machine, "args": {k: v for k, v in vars(args).items()}, "models": {}}
    workloads = make_workloads(torch, args.quick)
    everything = time.perf_counter()
    for name in args.models:
        workload = workloads[name]
        # Warm-up outside any timing: loads the kernels (cuDNN, cuBLAS) every tool then shares.
        model, optimizer = fresh(torch, workload, device)
        params = sum(p.numel() for p in model.parameters())
        make_step(torch, model, optimizer, workload, device)(2)
        del model, optimizer
        release(torch)
        baseline = torch.cuda.memory_allocated(device)
        print(f"## {name}: {workload.title}, {params / 1e6:.2f} M parameters\n", flush=True)
        entry = {"name": name, "title": workload.title, "params": params, "tools": {}}
        for tool in args.tools:
            print(f"### {LABELS[tool]}", flush=True)
            try:
                with memory_limit(torch, args.limit_bytes, index):
                    if tool == "true-max":
                        record = run_true_max(torch, workload, device, args)
                    elif tool in ("gpuexp", "gpuexp-trials"):
                        record = run_gpuexp(torch, workload, device, args, gpuexp, estimate=tool == "gpuexp")
                    elif tool == "lightning":
                        record = run_lightning(torch, workload, device, args)
                    else:
                        record = run_accelerate(torch, workload, device, args)
            except Exception as why:  # report it and go on with the next tool
                record = new_record(tool)
                record.update(status="error", reason=f"{type(why).__name__}: {why}", traceback=traceback.format_exc())
                print(f"  {tool} failed: {record['reason']}", flush=True)
                traceback.clear_frames(why.__traceback__)
                del why
            release(torch)
            left = torch.cuda.memory_allocated(device) - baseline
            record["left_after_tool_bytes"] = left
            if left > 64 << 20:
                print(f"  note: {gib(left)} still allocated after this tool", flush=True)
            entry["tools"][tool] = record
            print(flush=True)
        true = entry["tools"].get("true-max", {}).get("batch_size")
        for record in entry["tools"].values():
            size = record.get("batch_size")
            record["share_of_true_max"] = (size / true) if (true and size is not None) else None
        entry["checks"] = checks(entry)
        results["models"][name] = entry
        print(f"## {name}: results (limit {args.limit})\n\n{table(entry)}\n", flush=True)
        for line in notes(entry):
            print(line, flush=True)
        for check in entry["checks"]:
            print(check["line"], flush=True)
        print(flush=True)

    results["wall_s"] = time.perf_counter() - everything
    verdicts = [c["ok"] for e in results["models"].values() for c in e["checks"] if c["ok"] is not None]
    passed = bool(verdicts) and all(verdicts)
    results["result"] = "PASS" if passed else "FAIL"
    print(f"Total {results['wall_s']:.0f} s. Result: {results['result']}", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(results, out, indent=2, default=str)
            out.write("\n")
        print(f"wrote {args.json}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
