#!/usr/bin/env bash
# Checks a gpuexp wheel as users get it: the platform tag auditwheel finds for it, then, for each
# CPython from 3.9 to 3.13 (pyenv's, or python3.X on PATH), a pip install into a throwaway venv
# and an import, which needs neither torch nor an NVIDIA driver (NVML is opened at run time).
# Last, what `pip install .` builds from the source tree, in its own build environment: zig
# links it too, so auditwheel finds the same platform tag for it.
# Usage: tests/wheel_check.sh dist/gpuexp-*.whl   (make wheel-check builds the wheel first)
set -euo pipefail

wheel=${1:?usage: tests/wheel_check.sh dist/gpuexp-*.whl}
[ -f "$wheel" ] || { echo "no wheel at $wheel: run make build first" >&2; exit 1; }
command -v auditwheel >/dev/null || { echo "auditwheel is missing: pip install auditwheel" >&2; exit 1; }

echo "wheel: $(basename "$wheel")"
tag=manylinux_2_17_$(uname -m)
# auditwheel's verdict is the sentence naming the tag; its wrapped lines are joined back first.
audit() {
    local verdict
    verdict=$(auditwheel show "$1" | tr '\n' ' ' | grep -o 'is consistent with the following platform tag: "[^"]*"' || true)
    echo "auditwheel: ${verdict:-no platform tag found}"
    [[ $verdict == *"$tag"* ]] || { echo "expected $tag" >&2; exit 1; }
}
audit "$wheel"

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
pyenv_versions=${PYENV_ROOT:-$HOME/.pyenv}/versions
failed=0
checked=0
for minor in 9 10 11 12 13; do
    python=$(ls -d "$pyenv_versions"/3."$minor".*/bin/python3 2>/dev/null | sort -V | tail -1 || true)
    python=${python:-$(command -v python3."$minor" || true)}
    if [ -z "$python" ]; then
        echo "python 3.$minor: not installed here"
        failed=1
        continue
    fi
    venv=$scratch/venv3.$minor
    "$python" -m venv "$venv"
    if ! out=$("$venv/bin/python" -m pip install -q --no-index --no-deps "$wheel" 2>&1); then
        echo "python $("$python" -c 'import platform; print(platform.python_version())'): pip refuses the wheel: $out"
        failed=1
        continue
    fi
    if out=$("$venv/bin/python" - 2>&1 <<'EOF'
import platform, sys
import gpuexp
snapshot = gpuexp.snapshot()
assert "host RSS" in str(snapshot), snapshot
assert "torch" not in sys.modules
note = snapshot.notes[0] if snapshot.notes else "a driver answered"
print(f"python {platform.python_version()}: pip installed it, import gpuexp {gpuexp.__version__} ok, snapshot ok ({note})")
EOF
    ); then
        echo "$out"
        checked=$((checked + 1))
    else
        echo "python 3.$minor: import failed: $out"
        failed=1
    fi
done
echo "imported on $checked of 5 CPython versions"

source_venv=$scratch/from-source
python3 -m venv "$source_venv"
"$source_venv/bin/python" -m pip wheel -q --no-deps -w "$scratch/built" "$(dirname "$0")/.."
built=$(ls "$scratch"/built/gpuexp-*.whl)
echo "pip install . builds: $(basename "$built")"
audit "$built"
exit $failed
