"""gpuexp.estimate side by side with the real step: the predicted torch peak against the measured one.

    CUDA_VISIBLE_DEVICES=0 python bench/estimate.py [--json PATH] [--models conv,transformer,attention,mlp] [--repeat N]
    python bench/estimate.py --cpu-smoke

Run on a GPU machine with torch and the gpuexp wheel installed. Four models built in plain torch,
nothing downloaded, each trained by one real step (random inputs built on the GPU, forward, loss,
backward, AdamW step, zero_grad): the ResNet-ish conv net and the nn.TransformerEncoder LM of
bench/batch_size.py, a hand-written attention LM (q @ kᵀ, a causal mask, softmax, @ v, written
out; no nn.MultiheadAttention) and an MLP. Each model is built once and warmed up by one step at
batch size 2, so its optimizer state, cuBLAS and cuDNN handles exist, as in training. Then, at
three batch sizes each:

- estimate: gpuexp.estimate(step, bs), timed (its own wall time), with torch's peak counter
  reset before it, to check that it allocated nothing;
- measured: the real step, twice, each from an emptied cache with torch's peak counter reset:
  max_memory_allocated() less memory_allocated() before the step; the larger of the two.

Targets: every estimate within 5% of the measured peak, at most 2 s per estimate, nothing
allocated by an estimate. Exit status: 0 when every target is met, 1 when not, 2 when it cannot
be measured here (no CUDA GPU, gpuexp not installed). --cpu-smoke runs the estimates on the CPU
at the smallest sizes (nothing is measured there: torch has no allocator counters for the host)
and exits 0 when they work.
"""

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import batch_size as workloads_of  # noqa: E402  (the conv net and the TransformerEncoder LM)

TARGET_SHARE = 0.05
TARGET_SECONDS = 2.0
MODELS = ("conv", "transformer", "attention", "mlp")
SIZES = {"conv": (16, 64, 256), "transformer": (8, 32, 128), "attention": (8, 32, 128), "mlp": (256, 2048, 16384)}
ATTENTION = dict(d_model=512, heads=8, layers=4, seq_len=256, vocab=8192)
MLP = dict(inputs=1024, width=4096, layers=3, classes=10)


def make_workloads(torch):
    """The four models: batch_size.py's conv net and TransformerEncoder LM, and two more here."""
    nn = torch.nn
    F = nn.functional
    found = workloads_of.make_workloads(torch, False)
    a = ATTENTION

    class AttentionLM(nn.Module):
        """Pre-norm blocks whose causal self-attention is written out by hand."""

        def __init__(self):
            super().__init__()
            d = a["d_model"]
            self.embed = nn.Embedding(a["vocab"], d)
            self.position = nn.Parameter(torch.zeros(1, a["seq_len"], d))
            self.blocks = nn.ModuleList(
                nn.ModuleDict(
                    dict(
                        norm1=nn.LayerNorm(d),
                        qkv=nn.Linear(d, 3 * d),
                        proj=nn.Linear(d, d),
                        norm2=nn.LayerNorm(d),
                        up=nn.Linear(d, 4 * d),
                        down=nn.Linear(4 * d, d),
                    )
                )
                for _ in range(a["layers"])
            )
            self.head = nn.Linear(d, a["vocab"])

        def forward(self, tokens):
            x = self.embed(tokens) + self.position[:, : tokens.shape[1]]
            batch, length, d = x.shape
            heads = a["heads"]
            causal = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
            for block in self.blocks:
                q, k, v = block["qkv"](block["norm1"](x)).split(d, dim=-1)
                q, k, v = (t.view(batch, length, heads, d // heads).transpose(1, 2) for t in (q, k, v))
                scores = (q @ k.transpose(-2, -1)) / (d // heads) ** 0.5
                weights = scores.masked_fill(causal, float("-inf")).softmax(-1)
                x = x + block["proj"]((weights @ v).transpose(1, 2).reshape(batch, length, d))
                x = x + block["down"](F.gelu(block["up"](block["norm2"](x))))
            return self.head(x)

    def lm_batch(batch_size, device):
        shape = (batch_size, a["seq_len"])
        return torch.randint(0, a["vocab"], shape, device=device), torch.randint(0, a["vocab"], shape, device=device)

    def lm_loss(model, tokens, targets):
        logits = model(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    m = MLP

    def build_mlp():
        layers, width = [nn.Linear(m["inputs"], m["width"]), nn.ReLU()], m["width"]
        for _ in range(m["layers"] - 1):
            layers += [nn.Linear(width, width), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(width, m["classes"]))

    def mlp_batch(batch_size, device):
        return torch.randn(batch_size, m["inputs"], device=device), torch.randint(
            0, m["classes"], (batch_size,), device=device
        )

    found["attention"] = workloads_of.Workload(
        "attention",
        f"hand-written causal attention LM (d_model {a['d_model']}, {a['layers']} layers, {a['heads']} heads, "
        f"seq_len {a['seq_len']}, vocab {a['vocab']})",
        AttentionLM,
        lm_batch,
        lm_loss,
    )
    found["mlp"] = workloads_of.Workload(
        "mlp",
        f"MLP ({m['inputs']} → {m['layers']} × {m['width']} → {m['classes']})",
        build_mlp,
        mlp_batch,
        lambda model, x, y: F.cross_entropy(model(x), y),
    )
    return found


def measured_peak(torch, step, batch_size, device):
    """The real step's torch peak above what was allocated before it: the larger of two runs."""
    peaks = []
    for _ in range(2):
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step(batch_size)
        torch.cuda.synchronize(device)
        peaks.append(torch.cuda.max_memory_allocated(device) - before)
    return max(peaks)


def estimated(torch, gpuexp, step, batch_size, device):
    """gpuexp.estimate, timed, and what torch allocated while it ran (should be nothing)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    started = time.perf_counter()
    result = gpuexp.estimate(step, batch_size, device="cpu" if device.type == "cpu" else device)
    seconds = time.perf_counter() - started
    allocated = (torch.cuda.max_memory_allocated(device) - before) if cuda else 0
    return result, seconds, allocated


def run_model(torch, gpuexp, workload, device, sizes, measure, repeat=1):
    model, optimizer = workloads_of.fresh(torch, workload, device)
    step = workloads_of.make_step(torch, model, optimizer, workload, device)
    step(2)
    rows = []
    for batch_size in sizes:
        runs = [estimated(torch, gpuexp, step, batch_size, device) for _ in range(repeat)]
        result, _, _ = runs[0]
        times = [round(seconds, 3) for _, seconds, _ in runs]
        seconds = statistics.median(times)  # one estimate's time drifts with the host: the median of `repeat`
        allocated = max(allocated for _, _, allocated in runs)
        row = {
            "batch_size": batch_size,
            "estimate": result.peak,
            "seconds": round(seconds, 3),
            "all_seconds": times,
            "allocated_by_estimate": allocated,
            "categories": result.categories,
        }
        if measure:
            real = measured_peak(torch, step, batch_size, device)
            row.update(measured=real, ratio=result.peak / real, error=abs(result.peak - real) / real)
        rows.append(row)
        print(
            f"  {workload.name} batch size {batch_size}: estimate {gib(result.peak)} in {seconds:.2f} s"
            + (f", measured {gib(row['measured'])} ({100 * row['ratio']:.1f}%)" if measure else ""),
            flush=True,
        )
    del step, model, optimizer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def gib(n):
    return f"{n / 2**30:.3f} GiB"


def table(results):
    lines = [
        "| model | batch size | estimate | measured | estimate / measured | estimate time "
        "| allocated by the estimate |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, entry in results["models"].items():
        for row in entry["rows"]:
            lines.append(
                f"| {name} | {row['batch_size']} | {gib(row['estimate'])} | {gib(row['measured'])} | "
                f"{100 * row['ratio']:.1f}% | {row['seconds']:.2f} s | {row['allocated_by_estimate']} B |"
            )
    return "\n".join(lines)


def checks(results):
    rows = [(name, row) for name, entry in results["models"].items() for row in entry["rows"]]
    worst = max(rows, key=lambda r: r[1]["error"])
    slowest = max(rows, key=lambda r: r[1]["seconds"])
    allocated = max(row["allocated_by_estimate"] for _, row in rows)
    out = [
        (
            worst[1]["error"] <= TARGET_SHARE,
            f"every estimate within {TARGET_SHARE:.0%} of the measured peak "
            f"(worst: {worst[0]} at {worst[1]['batch_size']}, "
            f"{100 * worst[1]['ratio']:.1f}%)",
        ),
        (
            slowest[1]["seconds"] <= TARGET_SECONDS,
            f"every estimate within {TARGET_SECONDS:.0f} s (slowest: {slowest[0]} at {slowest[1]['batch_size']}, "
            f"{slowest[1]['seconds']:.2f} s)",
        ),
        (allocated == 0, f"no estimate allocated anything through torch (most: {allocated} B)"),
    ]
    return [{"ok": ok, "line": f"{'PASS' if ok else 'FAIL'} {line}"} for ok, line in out]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="also write every figure as JSON to PATH")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)}")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="time each estimate N times and report the median (for comparing two builds)")
    parser.add_argument("--cpu-smoke", action="store_true", help="estimate on the CPU at the smallest sizes; no GPU")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat {args.repeat}: give 1 or more")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models or any(m not in MODELS for m in models):
        parser.error(f"--models {args.models!r}: pick from {', '.join(MODELS)}")
    try:
        import torch

        import gpuexp
    except ImportError as why:
        print(f"estimate: {why}; run this where torch and the gpuexp wheel are installed", file=sys.stderr)
        return 2
    workloads = make_workloads(torch)
    if args.cpu_smoke:
        for name in models:
            rows = run_model(torch, gpuexp, workloads[name], torch.device("cpu"), SIZES[name][:1], measure=False)
            if not rows[0]["estimate"] > 0:
                return 1
        print("cpu-smoke: every model was estimated")
        return 0
    if not torch.cuda.is_available():
        print(
            "estimate: no CUDA GPU; this bench compares estimates with real steps on one (try --cpu-smoke here)",
            file=sys.stderr,
        )
        return 2
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.benchmark = False
    device = torch.device("cuda", torch.cuda.current_device())
    results = {
        "machine": {
            "gpu": torch.cuda.get_device_name(device),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "python": platform.python_version(),
        },
        "models": {},
    }
    print(
        f"# gpuexp.estimate against the real step\n\nMachine: {results['machine']['gpu']}, torch "
        f"{torch.__version__} (CUDA {torch.version.cuda}), Python {platform.python_version()}.\n",
        flush=True,
    )
    for name in models:
        workload = workloads[name]
        results["models"][name] = {
            "title": workload.title,
            "rows": run_model(torch, gpuexp, workload, device, SIZES[name], measure=True, repeat=args.repeat),
        }
    results["checks"] = checks(results)
    print("\n" + table(results) + "\n")
    for check in results["checks"]:
        print(check["line"])
    passed = all(check["ok"] for check in results["checks"])
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(results, out, indent=2)
            out.write("\n")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
