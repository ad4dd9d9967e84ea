"""What gpuexp's per-cell memory log costs in a real Jupyter kernel, beside two peer tools.

    python bench/cell_log_overhead.py [--json PATH] [--quick] [--cells N] [--repeats R]

Targets, each a ratio against a baseline kernel measured in the same run:
  (a) the cell log (`%gpuexp log on`) shows nothing after a trivial cell (nothing moved by 1 MiB)
      and adds at most 0.1 ms to it: in gpuexp's own kernel, blocks of cells with the log on
      against blocks with gpuexp unloaded (`%unload_ext gpuexp`), alternating; the baseline
      kernel gives the same comparison across processes, for reference and for the peers;
  (b) with the cell log on (and, on a GPU, its native sampler at 1 ms) three workloads run
      inside a cell are at most 2% slower: 20,000 small torch kernels (on CUDA when available),
      100,000 `os.stat` calls, and a pure Python loop of about 0.3 s.

Configurations, each in its own fresh kernel started from this very Python (`sys.executable -m
ipykernel_launcher`, PYTHONPATH inherited): "none" (no logger), "gpuexp", "ipyexperiments"
(IPyExperimentsPytorch with its CellLogger, the default; IPyExperimentsCPU where CUDA is missing)
and "ipython_memory_usage" (`%load_ext ipython_memory_usage` + `%imu_start`). torch is imported,
and CUDA initialised when available, in every kernel before the tool. A peer that is not
installed or fails to start is reported as "unavailable: <reason>" and skipped. Nothing is
installed by this script: it imports what exists (bench/requirements-peers.txt pins the peers).
Two optional extras: --with-rss-sampler adds gpuexp with GPUEXP_HOST_PEAK=sampled (its native
sampler then runs during every cell, even without a GPU), and --with-display-floor adds a kernel
whose only per-cell work is displaying an object as large as gpuexp's record: the floor that
IPython and ipykernel put under any logger that displays something after each cell.

Method: all kernels stay alive and configurations are interleaved in rounds, the order rotated
each round, so that drift falls on all of them alike. (a) times N cells of `pass` from the
client (execute request sent -> the kernel's idle status for it, every output received) and
compares medians; (b) times each workload with time.perf_counter() inside the cell, R times
per configuration after one warm-up run, and compares medians. gpuexp's (b) verdict compares
its own kernel with the log off and on, and fails a workload only when its median slowdown
less two standard errors is over 2%: on a machine whose runs differ by tens of percent, a
median alone would pass or fail by chance. Each table gives the two standard errors, so a
reader sees what the machine could resolve. IPython's history is kept in
memory (`--HistoryManager.hist_file=:memory:`) and IPYTHONDIR is a fresh directory, so that
four kernels don't write one SQLite file after every cell, and no user profile loads anything.

On the GPU machine (../shared/gpu/README.md): `make gpu-wheel`, `../shared/gpu/wheelhouse.sh
$(grep -v '^#' bench/requirements-peers.txt)` and `cp ../shared/gpu/env.sh .whl/` here, then with
.whl carried: `source .whl/env.sh && CUDA_VISIBLE_DEVICES=0 python3 bench/cell_log_overhead.py
--with-display-floor --json $OUT/cell_log_overhead.json`.

Exit status: 0 when gpuexp meets every target, 1 when it misses one, 2 when gpuexp (or the
baseline) could not be measured.
"""

import argparse
import gc
import json
import os
import platform
import queue
import shutil
import statistics
import sys
import tempfile
import time

from machine import cpu_model
from spread import median_error, significantly_above

TARGET_ADDED_MS = 0.1
TARGET_SLOWDOWN = 0.02
# (a)'s same-kernel comparison: the two states, and the cells of a block.
SAME_KERNEL_SWITCH = {"none": "%unload_ext gpuexp", "gpuexp": "%load_ext gpuexp\n%gpuexp log on"}
SAME_KERNEL_BLOCK = 10
SAME_KERNEL_WARMUP = 3
MARK = "@@gpuexp-bench@@"
CONFIGS = ("none", "gpuexp", "ipyexperiments", "ipython_memory_usage")
EXTRA_CONFIG = "gpuexp+rss-sampler"
FLOOR_CONFIG = "display-floor"
WORKLOADS = ("torch", "os.stat", "python loop")
PY_LOOP_SECONDS = 0.3

# ---- what runs inside the kernels ------------------------------------------------------------

COMMON_SETUP = """\
import gc, json, os, platform, sys, time
_BENCH = {"torch": None, "torch_error": None, "cuda": False, "device": None, "notes": []}
try:
    import torch
except Exception as _e:
    _BENCH["torch_error"] = f"{type(_e).__name__}: {_e}"
else:
    _BENCH["torch"] = torch.__version__
    if torch.cuda.is_available():
        torch.ones(1, device="cuda")
        torch.cuda.synchronize()
        _BENCH["cuda"] = True
    _BENCH["device"] = "cuda" if _BENCH["cuda"] else "cpu"

def _bench_sampler():  # whether gpuexp's native sampler thread runs, as /proc lists the threads
    if "gpuexp" not in sys.modules:
        return None
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{task}/comm").read().strip())
        except OSError:
            pass
    return "gpuexp-sampler" in names

def _bench_emit(**values):
    print(%r + json.dumps(values))
""" % MARK  # noqa: UP031 (the kernel code is full of braces that .format would need doubled)

SETUPS = {
    "none": "",
    "gpuexp": """\
import gpuexp
%gpuexp log on
_BENCH["gpuexp_config"] = gpuexp.config(sample_interval_ms=1) if _BENCH["cuda"] else gpuexp.config()
_BENCH["variant"] = "import gpuexp; %gpuexp log on" + (
    "; gpuexp.config(sample_interval_ms=1)" if _BENCH["cuda"] else "")
""",
    EXTRA_CONFIG: """\
import gpuexp
%gpuexp log on
_BENCH["gpuexp_config"] = gpuexp.config(sample_interval_ms=1)
_BENCH["variant"] = "GPUEXP_HOST_PEAK=sampled; import gpuexp; %gpuexp log on; gpuexp.config(sample_interval_ms=1)"
""",
    FLOOR_CONFIG: """\
from IPython.display import display as _bench_display
class _BenchFloor:
    def __repr__(self):
        return "x" * 119
    def _repr_html_(self):
        return "<pre>" + "x" * 463 + "</pre>"
def _bench_floor(result=None):
    _bench_display(_BenchFloor())
get_ipython().events.register("post_run_cell", _bench_floor)
_BENCH["variant"] = "a post_run_cell hook that only display()s an object as large as gpuexp's record, measuring nothing"
""",
    "ipyexperiments": """\
from ipyexperiments import IPyExperimentsPytorch
if _BENCH["cuda"]:
    exp = IPyExperimentsPytorch()
    _BENCH["variant"] = "exp = IPyExperimentsPytorch() (defaults: CellLogger on, gc.collect after each cell)"
else:
    from ipyexperiments import IPyExperimentsCPU
    exp = IPyExperimentsCPU()
    _BENCH["variant"] = ("exp = IPyExperimentsCPU() (no CUDA: IPyExperimentsPytorch requires it; "
                         "CellLogger on, gc.collect after each cell)")
""",
    "ipython_memory_usage": """\
import ipython_memory_usage
_bench_ip = get_ipython()
if hasattr(ipython_memory_usage, "load_ipython_extension"):
    _bench_ip.run_line_magic("load_ext", "ipython_memory_usage")
if _bench_ip.find_line_magic("imu_start"):
    _bench_ip.run_line_magic("imu_start", "")
    _BENCH["variant"] = "%load_ext ipython_memory_usage; %imu_start"
elif _bench_ip.find_line_magic("ipython_memory_usage_start"):
    _bench_ip.run_line_magic("ipython_memory_usage_start", "")
    _BENCH["variant"] = "import ipython_memory_usage; %ipython_memory_usage_start"
else:
    import ipython_memory_usage.ipython_memory_usage as _bench_imu
    _bench_imu.start_watching_memory()
    _BENCH["variant"] = "ipython_memory_usage.ipython_memory_usage.start_watching_memory()"
""",
}

# A cell that moves memory: gpuexp's quiet log shows a block only after such a cell.
MOVING_PROBE = "_bench_probe = bytearray(8 << 20)\ndel _bench_probe"
PROBES = {"gpuexp": MOVING_PROBE, EXTRA_CONFIG: MOVING_PROBE}
# What each logger prints after a cell; its absence after a probe cell means it did not start.
SIGNATURES = {
    "gpuexp": "gpuexp · cell",
    EXTRA_CONFIG: "gpuexp · cell",
    FLOOR_CONFIG: "xxxxxxxxxx",
    "ipyexperiments": "RAM:",
    "ipython_memory_usage": "MiB RAM",
}
PEER_PACKAGES = {"ipyexperiments": "ipyexperiments", "ipython_memory_usage": "ipython_memory_usage"}

REPORT_STATE = """\
_bench_versions = {}
import importlib.metadata as _bench_md
for _bench_pkg in ("gpuexp", "ipyexperiments", "ipython_memory_usage", "ipykernel", "ipython", "jupyter_client",
                   "pynvml", "nvidia-ml-py", "memory_profiler", "psutil"):
    try:
        _bench_versions[_bench_pkg] = _bench_md.version(_bench_pkg)
    except Exception:
        pass
_bench_info = dict(_BENCH, python=platform.python_version(), executable=sys.executable,
                   cpus=os.cpu_count(), platform=platform.platform(), versions=_bench_versions,
                   cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
                   gpuexp_host_peak=os.environ.get("GPUEXP_HOST_PEAK"))
if _BENCH["cuda"]:
    _bench_info.update(gpu=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count(), torch_cuda=torch.version.cuda)
_bench_emit(**_bench_info)
"""

WORKLOAD_CODE = {
    "torch": """\
_bench_t0 = time.perf_counter()
x = torch.ones(256, device=_BENCH["device"])
for _ in range(20000):
    x.add_(1)
if _BENCH["cuda"]:
    torch.cuda.synchronize()
_bench_emit(s=time.perf_counter() - _bench_t0, sampler=_bench_sampler())
""",
    "os.stat": """\
_bench_t0 = time.perf_counter()
for _ in range(100000):
    os.stat({path!r})
_bench_emit(s=time.perf_counter() - _bench_t0, sampler=_bench_sampler())
""",
    "python loop": """\
_bench_t0 = time.perf_counter()
s = 0
for i in range({iterations}):
    s += i
_bench_emit(s=time.perf_counter() - _bench_t0, sampler=_bench_sampler())
""",
}

CALIBRATE = """\
_bench_t0 = time.perf_counter()
s = 0
for i in range(1000000):
    s += i
_bench_emit(s=time.perf_counter() - _bench_t0)
"""

# Where gpuexp's per-cell time goes, timed inside its kernel (run last: it opens and closes
# cell windows of its own, so the cell that runs it shows no record).
BREAKDOWN = """\
import statistics as _bench_stats
import gpuexp as _bench_gpuexp
from gpuexp import _core as _bench_core, ipython as _bench_gi
from gpuexp.torch_peaks import watch_torch_peak_resets as _bench_watch
from IPython.display import display as _bench_display
def _bench_time(fn, n):
    samples = []
    for _ in range(n):
        t0 = time.perf_counter_ns(); fn(); samples.append(time.perf_counter_ns() - t0)
    return _bench_stats.median(samples) / 1e3
_bench_n = {n}
_bench_parts = {{}}
_bench_parts["cell_log_active()"] = _bench_time(_bench_core.cell_log_active, _bench_n)
_bench_parts["watch_torch_peak_resets()"] = _bench_time(_bench_watch, _bench_n)
_bench_b, _bench_e, _bench_running = [], [], []
for _ in range(_bench_n):
    t0 = time.perf_counter_ns(); _bench_core.begin_cell(); t1 = time.perf_counter_ns()
    _bench_running.append(_bench_sampler())
    t2 = time.perf_counter_ns(); _bench_core.end_cell(0); t3 = time.perf_counter_ns()
    _bench_b.append(t1 - t0); _bench_e.append(t3 - t2)
_bench_parts["_core.begin_cell()"] = _bench_stats.median(_bench_b) / 1e3
_bench_parts["_core.end_cell(0)"] = _bench_stats.median(_bench_e) / 1e3
_bench_rec = _bench_gpuexp.cells()[-1]  # the record of a trivial cell, shown only with `log all`
_bench_parts["str(record)"] = _bench_time(lambda: str(_bench_rec), _bench_n)
_bench_parts["record._repr_html_()"] = _bench_time(lambda: _bench_rec._repr_html_(), _bench_n)
_bench_parts["_core.snapshot(True)"] = _bench_time(lambda: _bench_core.snapshot(True), _bench_n)
_bench_parts["_core.snapshot(False) (host only)"] = _bench_time(lambda: _bench_core.snapshot(False), _bench_n)
class _BenchTiny:
    def __repr__(self):
        return "tiny"
    def _repr_html_(self):
        return "<b>tiny</b>"
_bench_shown, _bench_d_rec, _bench_d_tiny = min(_bench_n, 30), [], []
for _ in range(_bench_shown):  # alternated, so that both see the same IOPub backlog
    t0 = time.perf_counter_ns(); _bench_gi.show(_bench_rec); t1 = time.perf_counter_ns()
    _bench_display(_BenchTiny()); t2 = time.perf_counter_ns()
    _bench_d_rec.append(t1 - t0); _bench_d_tiny.append(t2 - t1)
_bench_parts[f"gpuexp's show(record), sent to the frontend (median of {{_bench_shown}})"] = (
    _bench_stats.median(_bench_d_rec) / 1e3)
_bench_parts["reference: IPython display() of a tiny object with text/plain + text/html"] = (
    _bench_stats.median(_bench_d_tiny) / 1e3)
_bench_data = {{"text/plain": str(_bench_rec), "text/html": _bench_rec._repr_html_()}}
_bench_emit(parts_us=_bench_parts, sampler_running_after_begin=sum(_bench_running) / len(_bench_running),
            mime_chars={{k: len(v) for k, v in _bench_data.items()}}, n=_bench_n)
"""


# ---- the client side -------------------------------------------------------------------------


class KernelFailed(Exception):
    pass


class Output:
    def __init__(self):
        self.stdout = []
        self.stderr = []
        self.displays = []
        self.live_views = 0  # drawings of gpuexp's live view (not the block that replaces it at the end)
        self.error = None
        self.elapsed = None

    @property
    def text(self):
        return "".join(self.stdout) + "".join(self.stderr) + "\n".join(self.displays)

    def values(self):
        found = []
        for line in "".join(self.stdout).splitlines():
            if line.startswith(MARK):
                found.append(json.loads(line[len(MARK):]))
        return found

    def value(self):
        found = self.values()
        if not found:
            raise KernelFailed(f"the cell printed no result line; output:\n{self.text[-2000:]}")
        return found[-1]


class Kernel:
    """One IPython kernel of this very Python, driven through jupyter_client's blocking client."""

    def __init__(self, name, spec_manager, env, cwd, timeout):
        from jupyter_client import KernelManager

        self.name = name
        self.timeout = timeout
        self.km = KernelManager(kernel_name="python3", kernel_spec_manager=spec_manager)
        self.km.start_kernel(env=env, cwd=cwd)
        self.kc = self.km.client()
        self.kc.start_channels()
        try:
            self.kc.wait_for_ready(timeout=120)
        except RuntimeError as why:
            self.shutdown()
            raise KernelFailed(f"kernel did not start: {why}") from None

    def execute(self, code):
        """Runs one cell; the elapsed time runs from the request to the kernel's idle status."""
        kc, out = self.kc, Output()
        start = time.perf_counter()
        msg_id = kc.execute(code, silent=False, store_history=True, allow_stdin=False)
        deadline = start + self.timeout
        while True:
            try:
                msg = kc.iopub_channel.get_msg(timeout=1.0)
            except queue.Empty:
                if not self.km.is_alive():
                    raise KernelFailed("the kernel died") from None
                if time.perf_counter() > deadline:
                    raise KernelFailed(f"a cell ran longer than {self.timeout} s") from None
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                (out.stdout if content.get("name") == "stdout" else out.stderr).append(content["text"])
            elif content.get("transient", {}).get("display_id", "").startswith("gpuexp-live-"):
                out.live_views += content["data"].get("text/plain", "").startswith("gpuexp · cell running")
            elif kind in ("display_data", "execute_result"):
                out.displays.append(content.get("data", {}).get("text/plain", ""))
            elif kind == "error":
                out.error = f"{content['ename']}: {content['evalue']}"
            elif kind == "status" and content["execution_state"] == "idle":
                break
        out.elapsed = time.perf_counter() - start
        while True:  # the execute_reply came before the idle status; take it off the queue
            try:
                reply = kc.shell_channel.get_msg(timeout=self.timeout)
            except queue.Empty:
                raise KernelFailed("no execute_reply") from None
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        return out

    def run(self, code):
        """Runs a cell that must not fail."""
        out = self.execute(code)
        if out.error:
            raise KernelFailed(f"{out.error}\n{''.join(out.stderr)[-1500:]}")
        return out

    def shutdown(self):
        try:
            self.kc.stop_channels()
        except Exception:
            pass
        try:
            self.km.shutdown_kernel(now=False)
        except Exception:
            try:
                self.km.shutdown_kernel(now=True)
            except Exception:
                pass


# ---- the bench -------------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="also write every figure as JSON to PATH")
    parser.add_argument("--quick", action="store_true", help="a short smoke run (N=30 cells, R=2 repeats)")
    parser.add_argument("--cells", "-n", type=int, help="trivial cells per configuration (default 1000)")
    parser.add_argument("--repeats", "-r", type=int, help="timed runs of each workload per configuration (default 5)")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated configurations to run (default: all of {', '.join(CONFIGS)}); "
                             "'none' is always run, as the baseline")
    parser.add_argument("--with-rss-sampler", action="store_true",
                        help=f"add a configuration {EXTRA_CONFIG!r}: gpuexp with GPUEXP_HOST_PEAK=sampled, so that its "
                             "native sampler thread runs during every cell even without a GPU (reads RSS every 1 ms)")
    parser.add_argument("--with-display-floor", action="store_true",
                        help=f"add a reference configuration {FLOOR_CONFIG!r}: a post_run_cell hook that only displays "
                             "an object as large as gpuexp's record, i.e. what any displayed per-cell output costs")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one cell may take (default 600)")
    parser.add_argument("--paired", type=int, default=21,
                        help="log-off/log-on pairs of each workload in gpuexp's own kernel, "
                             "the (b) verdict (default 21)")
    args = parser.parse_args(argv)
    args.cells = args.cells if args.cells is not None else (30 if args.quick else 1000)
    args.repeats = args.repeats if args.repeats is not None else (2 if args.quick else 5)
    args.warmup = 3 if args.quick else 10
    args.paired = min(args.paired, 2) if args.quick else args.paired
    args.breakdown_n = 50 if args.quick else 300
    if args.cells < 1 or args.repeats < 1:
        parser.error("--cells and --repeats must be at least 1")
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration(s) {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    args.config_names = ["none"] + [c for c in CONFIGS if c in names and c != "none"]
    if args.with_rss_sampler:
        args.config_names.append(EXTRA_CONFIG)
    if args.with_display_floor:
        args.config_names.append(FLOOR_CONFIG)
    return args


def log(message):
    print(f"[cell_log_overhead] {message}", file=sys.stderr, flush=True)


def rotated(items, shift):
    shift %= max(len(items), 1)
    return items[shift:] + items[:shift]


def kernel_spec_manager(root):
    """A kernelspec "python3" that starts this very interpreter, whatever else is installed."""
    from jupyter_client.kernelspec import KernelSpecManager

    spec_dir = os.path.join(root, "kernels", "python3")
    os.makedirs(spec_dir)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}",
                 "--HistoryManager.hist_file=:memory:"],
        "display_name": f"Python {platform.python_version()} (bench)",
        "language": "python",
        "metadata": {"debugger": False},
    }
    with open(os.path.join(spec_dir, "kernel.json"), "w", encoding="utf-8") as f:
        json.dump(spec, f)
    return KernelSpecManager(kernel_dirs=[os.path.join(root, "kernels")])


def kernel_env(root, name):
    env = dict(os.environ)
    env["IPYTHONDIR"] = os.path.join(root, f"ipython-{name}")
    env["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"
    env.pop("GPUEXP_HOST_PEAK", None)
    if name == EXTRA_CONFIG:
        env["GPUEXP_HOST_PEAK"] = "sampled"
    return env


def last_line(text):
    """The last non-empty line (where an error's message is), cut to 300 characters."""
    text = text.strip()
    lines = [line for line in text.splitlines() if line.strip()]
    return (lines[-1] if lines else text)[:300]


class Config:
    def __init__(self, name):
        self.name = name
        self.kernel = None
        self.unavailable = None  # the reason, once it can't be measured
        self.info = {}
        self.cell_s = []
        self.workload_s = {w: [] for w in WORKLOADS}
        self.workload_sampler = {w: [] for w in WORKLOADS}
        self.workload_client_s = {w: [] for w in WORKLOADS}
        self.paired_ratios = {w: [] for w in WORKLOADS}  # log on ÷ log off, in this config's own kernel
        self.same_kernel_deltas = []  # (a): a block's median with the log on − gpuexp unloaded, same kernel

    @property
    def ok(self):
        return self.unavailable is None

    def fail(self, reason):
        self.unavailable = reason
        log(f"{self.name}: unavailable: {reason}")
        if self.kernel is not None:
            self.kernel.shutdown()
            self.kernel = None


def start(config, spec_manager, root, workdir, args):
    """Starts the configuration's kernel and its logger; checks that the logger prints."""
    name = config.name
    package = PEER_PACKAGES.get(name)
    if package is not None:
        import importlib.util

        if importlib.util.find_spec(package) is None:
            config.fail(f"{package} is not installed (No module named {package!r})")
            return
    try:
        config.kernel = Kernel(name, spec_manager, kernel_env(root, name), workdir, args.timeout)
        config.kernel.run(COMMON_SETUP)
        setup = config.kernel.execute(SETUPS[name])
        if setup.error:
            config.fail(f"setup failed: {setup.error}")
            return
        probe = config.kernel.execute(PROBES.get(name, "pass"))
        callback_errors = [line for line in "".join(probe.stderr).splitlines() if "Error in callback" in line]
        if probe.error or callback_errors:
            config.fail(f"a trivial cell fails once it is on: {probe.error or callback_errors[0]}: "
                        f"{last_line(''.join(probe.stderr))}")
            return
        signature = SIGNATURES.get(name)
        if signature is not None and signature not in probe.text:
            config.fail(f"started, but printed no per-cell output (looked for {signature!r}); "
                        f"it printed: {last_line(probe.text) or 'nothing'}")
            return
        if name == "none" and probe.text.strip():
            log(f"none: a trivial cell printed {last_line(probe.text)!r}")
        if name in PROBES:
            trivial = config.kernel.execute("pass")
            if trivial.text.strip():
                config.fail(f"a trivial cell still shows something: {last_line(trivial.text)}")
                return
        config.info = config.kernel.run(REPORT_STATE).value()
        config.info["cpu"] = cpu_model()  # the kernel runs on this machine
        config.info["setup_output"] = setup.text[-3000:]
    except Exception as why:  # a kernel that can't start, or any surprise: the configuration is out, the bench goes on
        config.fail(str(why) if isinstance(why, KernelFailed) else f"{type(why).__name__}: {why}")


def measure_trivial_cells(configs, args):
    """(a): N rounds, one `pass` cell per configuration each, the order rotated every round."""
    live = [c for c in configs if c.ok]
    for c in live:
        for _ in range(args.warmup):
            guarded(c, lambda k: k.run("pass"))
    live = [c for c in live if c.ok]
    t0 = time.perf_counter()
    for r in range(args.cells):
        for c in rotated(live, r):
            if c.ok:
                out = guarded(c, lambda k: k.run("pass"))
                if out is not None:
                    c.cell_s.append(out.elapsed)
        if r in (0, args.cells // 2):
            log(f"(a) round {r + 1}/{args.cells}, {time.perf_counter() - t0:.1f} s so far")


def measure_same_kernel_cells(config, args):
    """(a) for gpuexp, in its own kernel: blocks of trivial cells with gpuexp unloaded
    (`%unload_ext gpuexp`: no logger at all) and with its log on, alternating which goes first.
    Separate kernels differ from each other by more than 0.1 ms a cell (process placement, memory
    layout: the same code measured +0.08 and +0.25 ms in two runs on one machine), so the verdict
    compares blocks of one process. The first cells after a switch are not timed."""
    for i in range(max(1, args.cells // SAME_KERNEL_BLOCK)):
        medians = {}
        for state in (("none", "gpuexp") if i % 2 == 0 else ("gpuexp", "none")):
            guarded(config, lambda k, code=SAME_KERNEL_SWITCH[state]: k.run(code))
            for _ in range(SAME_KERNEL_WARMUP):
                guarded(config, lambda k: k.run("pass"))
            times = [out.elapsed for out in (guarded(config, lambda k: k.run("pass")) for _ in range(SAME_KERNEL_BLOCK))
                     if out is not None]
            if len(times) < SAME_KERNEL_BLOCK:
                return
            medians[state] = statistics.median(times)
        config.same_kernel_deltas.append(medians["gpuexp"] - medians["none"])
    guarded(config, lambda k: k.run(SAME_KERNEL_SWITCH["gpuexp"]))
    log(f"(a) same kernel, {config.name}: {len(config.same_kernel_deltas)} pairs of blocks")


def guarded(config, fn):
    """Runs fn(kernel); a failure marks the configuration unavailable instead of ending the bench."""
    if not config.ok:
        return None
    try:
        return fn(config.kernel)
    except Exception as why:
        reason = str(why) if isinstance(why, KernelFailed) else f"{type(why).__name__}: {why}"
        config.fail(f"failed during the measurement: {last_line(reason)}")
        return None


def measure_workloads(configs, baseline, stat_path, args):
    """(b): one warm-up run, then R timed runs of each workload per configuration, interleaved."""
    iterations = 10_000_000
    calibration = guarded(baseline, lambda k: k.run(CALIBRATE).value())
    if calibration:
        calibration = guarded(baseline, lambda k: k.run(CALIBRATE).value())  # the second, warm
    if calibration:
        iterations = max(100_000, int(round(PY_LOOP_SECONDS / calibration["s"] * 1_000_000, -5)))
    codes = {
        "torch": WORKLOAD_CODE["torch"],
        "os.stat": WORKLOAD_CODE["os.stat"].format(path=stat_path),
        "python loop": WORKLOAD_CODE["python loop"].format(iterations=iterations),
    }
    skipped = {}
    if baseline.ok and baseline.info.get("torch") is None:
        skipped["torch"] = f"torch is not importable here ({baseline.info.get('torch_error')})"
    workloads = [w for w in WORKLOADS if w not in skipped]
    live = [c for c in configs if c.ok]
    for rep in range(args.repeats + 1):  # rep 0 is the warm-up
        for wi, workload in enumerate(workloads):
            for c in rotated(live, rep + wi):
                out = guarded(c, lambda k, code=codes[workload]: k.run(code))
                if out is None or rep == 0:
                    continue
                value = out.values()
                if not value:
                    c.fail(f"the {workload} cell printed no result: {last_line(out.text)}")
                    continue
                c.workload_s[workload].append(value[-1]["s"])
                c.workload_sampler[workload].append(value[-1].get("sampler"))
                c.workload_client_s[workload].append(out.elapsed)
        log(f"(b) {'warm-up' if rep == 0 else f'repeat {rep}/{args.repeats}'} done")
    gpuexp = next((c for c in live if c.name == "gpuexp"), None)
    if gpuexp is not None:
        measure_paired(gpuexp, codes, workloads, args.paired)
    return {"python_loop_iterations": iterations, "skipped": skipped, "workloads": workloads}


def measure_paired(config, codes, workloads, pairs):
    """(b) for gpuexp, in its own kernel: each workload with the log off and on, alternating
    which goes first. Separate kernels differ from each other by more than the 2% target
    (process placement, memory layout), so the verdict compares runs of one process."""
    for i in range(pairs):
        for workload in workloads:
            seconds = {}
            for state in (("off", "on") if i % 2 == 0 else ("on", "off")):
                guarded(config, lambda k, line=f"%gpuexp log {state}": k.run(line))
                out = guarded(config, lambda k, code=codes[workload]: k.run(code))
                if out is None or not out.values():
                    return
                seconds[state] = out.values()[-1]["s"]
            config.paired_ratios[workload].append(seconds["on"] / seconds["off"])
        log(f"(b) paired {i + 1}/{pairs} done")


def breakdown(config, args):
    return guarded(config, lambda k: k.run(BREAKDOWN.format(n=args.breakdown_n)).value())


# ---- report ----------------------------------------------------------------------------------


def quartiles(values):
    if len(values) < 2:
        return (values[0], values[0]) if values else (None, None)
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def summarize(configs, workload_meta):
    base = configs[0]
    summary = {"trivial_cell": {}, "workloads": {}}
    base_cell = statistics.median(base.cell_s) if base.ok and base.cell_s else None
    for c in configs:
        row = {"status": "ok" if c.ok else f"unavailable: {c.unavailable}", "variant": c.info.get("variant")}
        if c.ok and c.cell_s:
            median = statistics.median(c.cell_s)
            p25, p75 = quartiles(c.cell_s)
            row.update(n=len(c.cell_s), median_ms=median * 1e3, p25_ms=p25 * 1e3, p75_ms=p75 * 1e3,
                       mean_ms=statistics.fmean(c.cell_s) * 1e3, min_ms=min(c.cell_s) * 1e3)
            if base_cell is not None:
                row["added_ms"] = (median - base_cell) * 1e3
                if c is not base and len(c.cell_s) == len(base.cell_s):
                    # the same round's baseline cell, so that drift between rounds cancels
                    paired = [x - y for x, y in zip(c.cell_s, base.cell_s)]
                    row["paired_added_ms"] = statistics.median(paired) * 1e3
                    row["paired_added_error_ms"] = median_error(paired) * 1e3
        if c.same_kernel_deltas:
            row["same_kernel_pairs"] = len(c.same_kernel_deltas)
            row["same_kernel_added_ms"] = statistics.median(c.same_kernel_deltas) * 1e3
            row["same_kernel_error_ms"] = median_error(c.same_kernel_deltas) * 1e3
        summary["trivial_cell"][c.name] = row
    for w in workload_meta["workloads"]:
        base_w = statistics.median(base.workload_s[w]) if base.ok and base.workload_s[w] else None
        rows = {}
        for c in configs:
            row = {"status": "ok" if c.ok else f"unavailable: {c.unavailable}"}
            if c.ok and c.workload_s[w]:
                median = statistics.median(c.workload_s[w])
                row.update(n=len(c.workload_s[w]), median_s=median, min_s=min(c.workload_s[w]),
                           max_s=max(c.workload_s[w]), runs_s=c.workload_s[w],
                           sampler_running=c.workload_sampler[w], client_s=c.workload_client_s[w])
                if base_w:
                    row["ratio"] = median / base_w
                    row["slowdown_pct"] = (median / base_w - 1) * 100
                if c.paired_ratios[w]:
                    slowdowns = [r - 1 for r in c.paired_ratios[w]]
                    row["paired_ratios"] = c.paired_ratios[w]
                    row["paired_slowdown_pct"] = statistics.median(slowdowns) * 100
                    row["paired_slowdown_error_pct"] = median_error(slowdowns) * 100
                    row["paired_significantly_above_target"] = significantly_above(slowdowns, TARGET_SLOWDOWN)
            rows[c.name] = row
        summary["workloads"][w] = rows
    return summary


def verdicts(summary, gpuexp_names):
    out = {}
    for name in gpuexp_names:
        cell = summary["trivial_cell"].get(name, {})
        added = cell.get("same_kernel_added_ms", cell.get("paired_added_ms", cell.get("added_ms")))
        trivial = None if added is None else added <= TARGET_ADDED_MS
        out[name] = {"trivial_cell": trivial, "workloads": {}}
        for w, rows in summary["workloads"].items():
            row = rows.get(name, {})
            # The same-kernel comparison when there is one (see measure_paired): a workload fails
            # when its slowdown is over the target by more than this machine's noise can explain.
            if "paired_slowdown_pct" in row:
                out[name]["workloads"][w] = not row["paired_significantly_above_target"]
            else:
                out[name]["workloads"][w] = None if "ratio" not in row else row["ratio"] <= 1 + TARGET_SLOWDOWN
    return out


def verdict_word(value):
    return {True: "**PASS**", False: "**FAIL**", None: "n/a"}[value]


def fmt(value, spec):
    return "—" if value is None else format(value, spec)


def print_report(configs, summary, verdict, meta, machine, parts, args):
    names = [c.name for c in configs]
    print("# gpuexp cell-log overhead, in real Jupyter kernels\n")
    for key in ("cpu", "cpus", "gpu", "python", "torch", "torch_cuda", "platform", "executable"):
        if machine.get(key) is not None:
            print(f"- {key}: {machine[key]}")
    if not machine.get("cuda"):
        print("- gpu: none (torch.cuda.is_available() is False): the torch workload runs on the CPU")
    versions = machine.get("versions", {})
    if versions:
        print("- versions: " + ", ".join(f"{k} {v}" for k, v in sorted(versions.items())))
    print(f"- run: {args.cells} trivial cells and {args.repeats} runs of each workload per configuration"
          f" (after {args.warmup} warm-up cells and 1 warm-up run), configurations interleaved in rounds"
          f"{' (--quick)' if args.quick else ''}")
    for c in configs:
        variant = c.info.get("variant")
        if c.ok and variant:
            print(f"- {c.name}: `{variant}`")
    print()

    print(f"## (a) Trivial cell (`pass`), client-side wall time per cell: "
          f"target ≤ {TARGET_ADDED_MS} ms added by gpuexp\n")
    print("| configuration | median ms/cell | p25–p75 ms | added vs none (ms) | paired Δ (ms) | ± 2 SE (ms) "
          "| verdict |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name in names:
        row = summary["trivial_cell"][name]
        if not row["status"] == "ok":
            print(f"| {name} | {row['status']} | | | | | |")
            continue
        if name == "none":
            word = "baseline"
        elif name in verdict:
            word = "gpuexp (verdict below)" if "same_kernel_added_ms" in row else (
                f"{verdict_word(verdict[name]['trivial_cell'])} (≤ {TARGET_ADDED_MS} ms)")
        elif name == FLOOR_CONFIG:
            word = "reference"
        else:
            word = "peer"
        print(f"| {name} | {fmt(row.get('median_ms'), '.3f')} "
              f"| {fmt(row.get('p25_ms'), '.3f')}–{fmt(row.get('p75_ms'), '.3f')}"
              f" | {'—' if name == 'none' else fmt(row.get('added_ms'), '+.3f')}"
              f" | {'—' if name == 'none' else fmt(row.get('paired_added_ms'), '+.3f')}"
              f" | {'—' if name == 'none' else fmt(2 * row.get('paired_added_error_ms', float('nan')), '.3f')}"
              f" | {word} |")
    print()
    print("added = its median − none's median; paired Δ = the median over rounds of its cell − none's "
          "cell in the same round, so that drift between rounds cancels; ± 2 SE = two standard "
          "errors of that median, from the middle half's spread. These compare separate kernels.\n")
    same = {n: summary["trivial_cell"][n] for n in verdict if "same_kernel_added_ms" in summary["trivial_cell"][n]}
    if same:
        print(f"gpuexp's verdict: one kernel, gpuexp unloaded (`{SAME_KERNEL_SWITCH['none']}`, no logger at all) "
              f"and loaded with its log on, in alternating blocks of {SAME_KERNEL_BLOCK} timed trivial cells "
              f"({SAME_KERNEL_WARMUP} untimed cells after each switch); added = the median over pairs of blocks "
              "of the log-on block's median − the unloaded block's. Separate kernels differ from each other "
              "by more than the target: process placement and memory layout.\n")
        print("| configuration | pairs of blocks | added per cell (ms) | ± 2 SE (ms) | verdict |")
        print("|---|---:|---:|---:|---|")
        for name, row in same.items():
            print(f"| {name} | {row['same_kernel_pairs']} | {row['same_kernel_added_ms']:+.3f} "
                  f"| {2 * row['same_kernel_error_ms']:.3f} "
                  f"| {verdict_word(verdict[name]['trivial_cell'])} (≤ {TARGET_ADDED_MS} ms) |")
        print()

    print(f"## (b) Workloads inside a cell, median seconds (perf_counter in the cell): "
          f"target ≤ {TARGET_SLOWDOWN:.0%} slowdown with gpuexp\n")
    header, align = ["workload", "none (s)", "none spread"], ["---", "---:", "---:"]
    for name in names[1:]:
        header += [f"{name} (s)", "slowdown"]
        align += ["---:", "---:"]
        if name in verdict:
            header.append("verdict")
            align.append("---")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join(align) + "|")
    for w in WORKLOADS:
        if w in meta["skipped"]:
            print(f"| {w} | skipped: {meta['skipped'][w]} |" + " |" * (len(header) - 2))
            continue
        rows = summary["workloads"].get(w, {})
        label = w
        if w == "torch":
            label = f"torch add_ ×20,000 ({machine.get('device') or 'cpu'})"
        elif w == "os.stat":
            label = "os.stat ×100,000"
        elif w == "python loop":
            label = f"python loop ×{meta['python_loop_iterations']:,}"
        base_row = rows.get("none", {})
        spread = None
        if base_row.get("median_s"):
            spread = (base_row["max_s"] - base_row["min_s"]) / base_row["median_s"] * 100
        cells = [label, fmt(base_row.get("median_s"), ".4f"), fmt(spread, ".1f") + ("%" if spread is not None else "")]
        for name in names[1:]:
            row = rows.get(name, {})
            if row.get("status", "ok") != "ok":
                cells += ["unavailable", ""]
            else:
                slowdown = fmt(row.get("slowdown_pct"), "+.2f") + ("%" if "slowdown_pct" in row else "")
                cells += [fmt(row.get("median_s"), ".4f"), slowdown]
            if name in verdict:
                cells.append(verdict_word(verdict[name]["workloads"].get(w)))
        print("| " + " | ".join(cells) + " |")
    print()
    print("none spread = (slowest − fastest) / median of the baseline's runs: a slowdown smaller than that is "
          "within this machine's run-to-run noise. Columns compare separate kernels.\n")
    paired = summary["workloads"]
    if any("paired_slowdown_pct" in rows.get("gpuexp", {}) for rows in paired.values()):
        print("gpuexp's verdict: the same workload in gpuexp's own kernel with `%gpuexp log off` and `on`, "
              "alternating, median of the on/off ratios (separate kernels differ by more than the target). "
              "A workload fails when its slowdown less two standard errors is over the target; where two "
              "standard errors are larger than the target, this machine is too noisy to resolve it:\n")
        print("| workload | pairs | slowdown (log on vs off, same kernel) | ± 2 SE | range | verdict |")
        print("|---|---:|---:|---:|---:|---|")
        for w, rows in paired.items():
            row = rows.get("gpuexp", {})
            if "paired_slowdown_pct" in row:
                ratios = row["paired_ratios"]
                print(f"| {w} | {len(ratios)} | {row['paired_slowdown_pct']:+.2f}% | "
                      f"{2 * row['paired_slowdown_error_pct']:.2f}% | "
                      f"{(min(ratios) - 1) * 100:+.1f}% … {(max(ratios) - 1) * 100:+.1f}% | "
                      f"{verdict_word(verdict['gpuexp']['workloads'].get(w))} |")
        print()
    for name in verdict:
        sampled = [s for w in summary["workloads"].values() for s in w.get(name, {}).get("sampler_running", [])]
        if sampled:
            on = sum(1 for s in sampled if s)
            print(f"gpuexp's native sampler was running at the end of {on} of {len(sampled)} "
                  f"timed workload cells ({name}).")
            if on == 0:
                print("(No GPU, and the host's peak RSS is exact without sampling: the sampler does not run here, "
                      "so (b) measures only gpuexp's per-cell hooks. On a GPU machine it samples NVML every 1 ms.)")
    print()

    unavailable = [c for c in configs if not c.ok]
    for c in unavailable:
        print(f"- {c.name}: unavailable: {c.unavailable}")
    if unavailable:
        print()

    if parts:
        names_b = list(parts)
        n = parts[names_b[0]]["n"]
        print(f"## Where gpuexp's per-cell time goes (inside the kernel, median µs of {n} calls)\n")
        print("| step | " + " | ".join(f"{name} µs" for name in names_b) + " |")
        print("|---|" + "---:|" * len(names_b))
        for step in parts[names_b[0]]["parts_us"]:
            figures = (fmt(parts[name]["parts_us"].get(step), ".1f") for name in names_b)
            print(f"| `{step}` | " + " | ".join(figures) + " |")
        print()
        for name, part in parts.items():
            us = part["parts_us"]
            hooks = us["_core.begin_cell()"] + us["_core.end_cell(0)"]
            shown = next(v for k, v in us.items() if k.startswith("gpuexp's show(record)"))
            tiny = us["reference: IPython display() of a tiny object with text/plain + text/html"]
            line = (f"- {name}: begin_cell + end_cell {hooks:.0f} µs (the sampler thread was running after begin_cell "
                    f"in {part['sampler_running_after_begin']:.0%} of the calls); a trivial cell shows nothing; "
                    f"a block, when one shows, costs {shown:.0f} µs, rendering included; IPython's display() of a "
                    f"tiny object {tiny:.0f} µs")
            cell = summary["trivial_cell"].get(name, {})
            added = cell.get("same_kernel_added_ms", cell.get("paired_added_ms"))
            if added is not None:
                line += f"; client-measured added time per trivial cell {added * 1e3:.0f} µs"
            print(line + ".")
        chars = parts[names_b[0]]["mime_chars"]
        print("- A cell's block, when it shows: " + ", ".join(f"{k} {v:,} chars" for k, v in chars.items()) + ".")
        print()


def main(argv=None):
    args = parse_args(argv)
    try:
        import jupyter_client  # noqa: F401
    except ImportError as why:
        print(f"cell_log_overhead: jupyter_client is not importable ({why})", file=sys.stderr)
        return 2
    root = tempfile.mkdtemp(prefix="gpuexp-bench-")
    workdir = os.path.join(root, "work")
    os.makedirs(workdir)
    stat_path = os.path.join(workdir, "stat-me.txt")
    with open(stat_path, "w") as f:
        f.write("x\n")
    configs = [Config(name) for name in args.config_names]
    try:
        spec_manager = kernel_spec_manager(root)
        for c in configs:
            log(f"starting {c.name}")
            start(c, spec_manager, root, workdir, args)
        base = configs[0]
        if not base.ok:
            print(f"cell_log_overhead: the baseline kernel could not run: {base.unavailable}", file=sys.stderr)
            return 2
        gc_was_enabled = gc.isenabled()
        gc.collect()
        gc.disable()  # no collection pause of this process inside a timed cell
        try:
            measure_trivial_cells(configs, args)
            for c in configs:
                if c.name in ("gpuexp", EXTRA_CONFIG) and c.ok:
                    measure_same_kernel_cells(c, args)
            meta = measure_workloads(configs, base, stat_path, args)
        finally:
            if gc_was_enabled:
                gc.enable()
        gpuexp_names = [n for n in ("gpuexp", EXTRA_CONFIG) if n in args.config_names]
        parts = {}
        for c in configs:
            if c.name in gpuexp_names and c.ok:
                part = breakdown(c, args)
                if part is not None:
                    parts[c.name] = part
        summary = summarize(configs, meta)
        verdict = verdicts(summary, gpuexp_names)
        machine = base.info
        print_report(configs, summary, verdict, meta, machine, parts, args)
        results = [v for name in verdict for v in [verdict[name]["trivial_cell"], *verdict[name]["workloads"].values()]]
        main_verdict = verdict.get("gpuexp")
        main_results = ([] if main_verdict is None
                        else [main_verdict["trivial_cell"], *main_verdict["workloads"].values()])
        if not main_results or None in main_results:
            status, word = 2, "gpuexp could not be measured on every target"
        elif all(main_results):
            status, word = 0, "PASS: gpuexp meets every target"
        else:
            status, word = 1, "FAIL: gpuexp misses a target"
        print(word)
        if args.json:
            out = {
                "machine": machine,
                "args": {k: v for k, v in vars(args).items() if k != "json"},
                "targets": {"trivial_cell_added_ms": TARGET_ADDED_MS, "workload_slowdown": TARGET_SLOWDOWN},
                "configs": {c.name: {"status": "ok" if c.ok else f"unavailable: {c.unavailable}", "info": c.info,
                                     "trivial_cell_s": c.cell_s} for c in configs},
                "trivial_cell": summary["trivial_cell"],
                "workloads": summary["workloads"],
                "workload_meta": meta,
                "verdicts": verdict,
                "gpuexp_breakdown": parts,
                "all_pass": status == 0,
                "every_target_measured": None not in results,
            }
            directory = os.path.dirname(os.path.abspath(args.json))
            os.makedirs(directory, exist_ok=True)
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(out, f, indent=2, default=str)
                f.write("\n")
        return status
    finally:
        for c in configs:
            if c.kernel is not None:
                c.kernel.shutdown()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
