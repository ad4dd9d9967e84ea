"""What the benches say about the machine they ran on (imported by the scripts beside it)."""

import platform


def cpu_model():
    """The CPU's model name, as /proc/cpuinfo gives it."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
