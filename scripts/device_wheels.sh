#!/usr/bin/env bash
# Build, here, every wheel that scripts/device_setup.sh installs on the GPU machine.
#
#   scripts/device_wheels.sh            # -> .whl/a, .whl/b, ... (each under 60 MiB)
#   scripts/device_wheels.sh --check    # the same, then import the set in a Python 3.12 venv
#
# The GPU machine has Python 3.12.3 and no registry, so the Merlin 23.x stack travels as
# wheels through the device tool, at most 64 MiB a call. Everything comes from pinned lists
# in scripts/device-wheels/:
#   download.txt  binary wheels: `pip download --no-deps --only-binary=:all:` for CPython 3.12
#                 on manylinux x86_64 (the device README's command);
#   build.txt     packages with no cp312 wheel on the registry (nvtabular's C++ extension,
#                 the pure-Python Merlin/T4R sdists): `pip wheel --no-deps` with Python 3.12.
# The wheels are then split, largest first, into folders .whl/a, .whl/b, ... of at most
# T4R_WHEEL_FOLDER_MIB MiB each: carry one folder per device call (device_setup.sh waits
# until all have arrived). MANIFEST.txt in .whl/ lists folder, size and sha256 of each wheel.
#
# Knobs: T4R_PY312 (a CPython 3.12 interpreter with pip; default python3.12 on PATH, else
# pyenv's 3.12.x), T4R_WHEEL_FOLDER_MIB (default 60), T4R_WHEEL_OUT (default .whl).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
lists="$root/scripts/device-wheels"
out="${T4R_WHEEL_OUT:-$root/.whl}"
cap_mib="${T4R_WHEEL_FOLDER_MIB:-60}"
check=0
[ "${1:-}" = "--check" ] && check=1

py=""
for candidate in ${T4R_PY312:-} python3.12 "$HOME"/.pyenv/versions/3.12.*/bin/python3.12; do
  if "$candidate" -c 'import sys, pip; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    py="$candidate"
    break
  fi
done
if [ -z "$py" ]; then
  echo "device_wheels: need a CPython 3.12 with pip (set T4R_PY312)" >&2
  exit 2
fi
echo "device_wheels: building with $py ($("$py" --version 2>&1), $("$py" -m pip --version | cut -d' ' -f1-2))"

stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT

# 1. Binary wheels for the machine's interpreter, whatever this machine runs.
"$py" -m pip download --quiet --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp \
  --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$stage" -r "$lists/download.txt"

# 2. Wheels built from sdists with Python 3.12 (pip builds each in an isolated environment).
"$py" -m pip wheel --quiet --no-deps -w "$stage" -r "$lists/build.txt"

# One version of each project, or pip refuses the whole install on the machine.
dupes="$(ls "$stage" | sed 's/-[0-9].*//' | tr 'A-Z-' 'a-z_' | sort | uniq -d)"
if [ -n "$dupes" ]; then
  echo "device_wheels: more than one wheel of: $dupes" >&2
  exit 1
fi

# 3. Split into folders of at most cap_mib MiB, largest wheel first (first fit).
rm -rf "$out"
mkdir -p "$out"
"$py" - "$stage" "$out" "$cap_mib" <<'EOF'
import hashlib, pathlib, shutil, string, sys

stage, out, cap_mib = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), float(sys.argv[3])
cap = cap_mib * 2**20
wheels = sorted(stage.glob("*.whl"), key=lambda p: p.stat().st_size, reverse=True)
folders = []  # [bytes used, [wheels]]
for wheel in wheels:
    size = wheel.stat().st_size
    if size > cap:
        sys.exit(f"device_wheels: {wheel.name} alone is {size / 2**20:.1f} MiB, over {cap_mib} MiB")
    home = next((f for f in folders if f[0] + size <= cap), None)
    if home is None:
        home = [0, []]
        folders.append(home)
    home[0] += size
    home[1].append(wheel)
lines = []
for letter, (used, members) in zip(string.ascii_lowercase, folders):
    (out / letter).mkdir()
    for wheel in sorted(members):
        shutil.move(str(wheel), out / letter / wheel.name)
        digest = hashlib.sha256((out / letter / wheel.name).read_bytes()).hexdigest()
        lines.append(f"{letter}  {(out / letter / wheel.name).stat().st_size:>10}  {digest}  {wheel.name}")
    print(f"device_wheels: .whl/{letter}: {len(members)} wheels, {used / 2**20:.1f} MiB")
(out / "MANIFEST.txt").write_text("\n".join(lines) + "\n")
print("device_wheels: T4R_WHEEL_DIRS=\"" + " ".join(string.ascii_lowercase[: len(folders)]) + "\"")
EOF

[ "$check" = 1 ] || exit 0

# 4. --check: install the set with --no-deps into a throwaway Python 3.12 venv, with stand-ins
# for what the machine already has (device-stand-ins.txt), relax the tokenizers pin exactly as
# device_setup.sh does, and import everything that does not need torch or a GPU.
venv="$stage/venv"
"$py" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --no-deps "$out"/*/*.whl
"$venv/bin/python" -m pip install --quiet --no-deps --only-binary=:all: -r "$lists/device-stand-ins.txt"
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
"$venv/bin/python" "$lists/relax_tokenizers_pin.py" "$site"
DASK_DATAFRAME__QUERY_PLANNING=False USE_TORCH=0 USE_TF=0 USE_JAX=0 "$venv/bin/python" -W ignore - <<'EOF'
import importlib.metadata as md
import numpy, pandas, pyarrow, scipy.sparse, dask.dataframe, distributed
import merlin.core.dispatch, merlin.io, merlin.dag, merlin.schema, merlin.dataloader
import nvtabular, nvtabular_cpp, nvtabular.ops
import merlin.systems.dag
import tritonclient.grpc, tritonclient.http
import transformers
print("device_wheels --check: imports OK on", __import__("sys").version.split()[0])
for name in ("numpy", "pandas", "pyarrow", "dask", "nvtabular", "merlin-core", "merlin-systems",
             "transformers", "tokenizers", "huggingface_hub", "tritonclient", "nvidia-pytriton"):
    print(f"  {name} {md.version(name)}")
EOF
