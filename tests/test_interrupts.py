"""Jupyter's interrupt button pressed while an experiment tears down: gpuexp holds the interrupt
until every step has run and the report is shown, then raises it."""

import time

from nbclient.util import run_sync

SETUP = """\
import time
import numpy as np
import gpuexp
from gpuexp import CPUExperiment

class Slow:
    '''Makes a teardown slow: each one takes 50 ms to go.'''
    def __del__(self):
        time.sleep(0.05)
"""

MiB = 1 << 20


def run_and_interrupt(kernel, source, after_s):
    """Runs a cell, interrupts the kernel `after_s` into it; returns (reply status, ename, text shown)."""
    kc, km = kernel.client.kc, kernel.client.km
    msg_id = kc.execute(source)
    time.sleep(after_s)
    run_sync(km.interrupt_kernel)()
    shown = []
    while True:
        msg = run_sync(kc.get_iopub_msg)(timeout=60)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        content = msg["content"]
        if msg["msg_type"] == "stream":
            shown.append(content["text"])
        elif msg["msg_type"] in ("display_data", "execute_result"):
            shown.append(content["data"].get("text/plain", ""))
        elif msg["msg_type"] == "status" and content["execution_state"] == "idle":
            break
    while True:
        reply = run_sync(kc.get_shell_msg)(timeout=60)
        if reply["parent_header"].get("msg_id") == msg_id:
            break
    return reply["content"]["status"], reply["content"].get("ename"), "".join(shown)


def test_twenty_interrupts_during_teardowns_lose_no_report_and_leave_no_hidden_reference(kernel):
    kernel.run(SETUP)
    outcomes = []
    for attempt in range(20):
        name = f"slow-{attempt}"
        kernel.run(f"exp = CPUExperiment({name!r}, cell_log=False)")
        kernel.run("big = np.ones(100 << 20, dtype=np.uint8)\nbig")  # displayed: Out and _ hold it
        kernel.run("slow = [Slow() for _ in range(30)]")
        # Offsets from the start of `del exp` into its 1.5 s of teardown.
        status, ename, shown = run_and_interrupt(kernel, "del exp", after_s=0.05 + 0.07 * attempt)
        outcomes.append(ename)
        assert f"{name} · finished" in shown, f"attempt {attempt}: no report shown\n{shown}"
        assert "teardown step" not in shown, f"attempt {attempt}: a step was cut short\n{shown}"
        assert status == "ok" or ename == "KeyboardInterrupt", (status, ename)
        time.sleep(0.1)
        report = kernel.value("gpuexp.history()[-1].to_dict()")
        assert report["name"] == name and set(report["deleted"]) >= {"big", "slow"}, report
        hidden = kernel.value(
            "sum(getattr(v, 'nbytes', 0) for v in [*Out.values(), _, __, ___] if isinstance(v, np.ndarray))"
        )
        assert hidden == 0, f"attempt {attempt}: {hidden} bytes still held by Out or _"
    assert kernel.value("len(gpuexp.history())") == 20
    # The interrupts were not swallowed: the user still sees that they were taken.
    assert outcomes.count("KeyboardInterrupt") >= 15, outcomes
