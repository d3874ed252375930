# shellcheck shell=bash
# Set up the Merlin 23.x / Transformers4Rec stack on the GPU machine from the wheels in .whl/.
#
#   scripts/device_wheels.sh              # HERE, once: builds .whl/a .whl/b .whl/c (DEVELOPERS.md)
#   source scripts/device_setup.sh        # THERE, from the repository root; safe to source again
#
# The wheels travel in several folders (.whl/a, .whl/b, ...), one folder per device call,
# because one call carries at most 64 MiB. Until every folder named in T4R_WHEEL_DIRS is
# present this only reports what is still missing; once all are there it installs them all
# in ONE pip call, then runs an import smoke test. A stamp makes later calls skip pip.
#
# Why a venv and not just `pip install --target /tmp/site` + PYTHONPATH: Triton's Python
# backend stub starts an isolated interpreter that ignores PYTHONPATH, so models served by
# tritonserver would not see the packages in /tmp/site (measured: "No module named 'merlin'").
# A --without-pip venv made from the machine's python, whose site-packages hold our wheels
# and whose .pth files add (after them) the machine's site-packages and this repo, is seen by
# the stub too, because merlin_t4r_ops puts the running interpreter's bin first on PATH.
# Our wheels (numpy 1.26, pandas 2.2, pyarrow 16, scipy 1.17, transformers 4.30, ...) come
# first on sys.path and so shadow the machine's newer ones; torch, cupy, numba, grpcio, ...
# still come from the machine. It also exports DASK_DATAFRAME__CONVERT_STRING=False (see below).
#
# transformers 4.30.2 refuses, at import, the machine's tokenizers 0.23 (it pins <0.14, which
# has no cp312 wheel): after the install, scripts/device-wheels/relax_tokenizers_pin.py drops
# that upper bound from the installed copy's dependency table and prints the diff in the log.
#
# Knobs: T4R_WHEEL_DIRS (default "a b c", what device_wheels.sh prints), T4R_VENV (default /tmp/t4r-venv),
# T4R_BASE_PYTHON (default: the python3 on PATH when the venv is first made),
# T4R_SKIP_SMOKE=1 to skip the smoke test.

_t4r_setup() {
  local root="$PWD"
  if [ ! -f "$root/setup.cfg" ] || [ ! -d "$root/merlin_t4r_ops" ]; then
    echo "device_setup: run this from the repository root (found no merlin_t4r_ops in $root)" >&2
    return 2
  fi
  local venv="${T4R_VENV:-/tmp/t4r-venv}"
  local dirs="${T4R_WHEEL_DIRS:-a b c}"

  # The machine's interpreter: remembered in the venv, since after the first source python3
  # on PATH is the venv's own.
  local base="${T4R_BASE_PYTHON:-}"
  if [ -z "$base" ] && [ -f "$venv/.t4r_base_python" ]; then base="$(cat "$venv/.t4r_base_python")"; fi
  if [ -z "$base" ]; then base="$(command -v python3)"; fi
  if [ -z "$base" ] || [ ! -x "$base" ]; then
    echo "device_setup: no python3 found" >&2
    return 2
  fi

  # Which wheel folders have arrived?
  local d missing="" wheels=()
  for d in $dirs; do
    if compgen -G "$root/.whl/$d/*.whl" >/dev/null; then
      wheels+=("$root"/.whl/"$d"/*.whl)
    else
      missing="$missing .whl/$d"
    fi
  done
  echo "device_setup: ${#wheels[@]} wheels present under .whl/ ($(du -sh "$root/.whl" 2>/dev/null | cut -f1))"
  if [ -n "$missing" ]; then
    echo "device_setup: still missing:$missing -- carry it in the next call; nothing installed yet"
    return 0
  fi

  # The venv (once).
  if [ ! -x "$venv/bin/python3" ]; then
    echo "device_setup: creating $venv from $base ($("$base" --version 2>&1))"
    if ! "$base" -m venv --without-pip "$venv"; then
      echo "device_setup: '$base -m venv' failed" >&2
      return 1
    fi
    echo "$base" > "$venv/.t4r_base_python"
  fi
  local site
  site="$("$venv/bin/python3" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" || return 1
  # After our site-packages: the machine's site-packages (with its own .pth files), then the repo.
  "$base" - "$site/zz_t4r_base_env.pth" <<'EOF' || return 1
import sys, sysconfig
paths = []
for key in ("purelib", "platlib"):
    p = sysconfig.get_path(key)
    if p not in paths:
        paths.append(p)
with open(sys.argv[1], "w") as f:
    f.write("import site; " + "; ".join("site.addsitedir(%r)" % p for p in paths) + "\n")
EOF
  echo "$root" > "$site/zz_t4r_repo.pth"
  # The console scripts pip would make for this repo (setup.cfg [options.entry_points]); the
  # tests and Merlin's own launcher look for `tritonserver` on PATH.
  local spec name target
  for spec in "merlin-t4r-serve=serve_main" "tritonserver=tritonserver_main"; do
    name="${spec%%=*}"; target="${spec#*=}"
    printf '#!%s\nimport sys\nfrom merlin_t4r_ops.serving.cli import %s\nif __name__ == "__main__":\n    sys.exit(%s())\n' \
      "$venv/bin/python3" "$target" "$target" > "$venv/bin/$name"
    chmod +x "$venv/bin/$name"
  done

  # Install every wheel in one pip call, unless this exact set is installed already.
  local stamp_new stamp_file="$venv/.t4r_wheels_installed"
  stamp_new="$(for w in "${wheels[@]}"; do basename "$w"; done | sort | sha256sum | cut -c1-16)"
  if [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp_new" ]; then
    echo "device_setup: these ${#wheels[@]} wheels are installed already in $site"
  else
    echo "device_setup: installing ${#wheels[@]} wheels into $site"
    if ! "$base" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "${wheels[@]}"; then
      echo "device_setup: pip install failed" >&2
      return 1
    fi
    echo "$stamp_new" > "$stamp_file"
  fi
  # The one reviewed change to an installed package (see the header); idempotent.
  "$base" "$root/scripts/device-wheels/relax_tokenizers_pin.py" "$site" || return 1

  export VIRTUAL_ENV="$venv"
  case ":$PATH:" in *":$venv/bin:"*) ;; *) export PATH="$venv/bin:$PATH" ;; esac
  case ":${PYTHONPATH:-}:" in *":$root:"*) ;; *) export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" ;; esac
  # dask 2023.7 turns object columns into pyarrow strings by default once pandas>=2 and
  # pyarrow are present, which stringifies Merlin's list columns ('[25 26 27]') and breaks
  # the torch dataloader (measured). Dask's own config switch turns that off.
  export DASK_DATAFRAME__CONVERT_STRING="${DASK_DATAFRAME__CONVERT_STRING:-False}"
  # Measured on the H200 (Python 3.12.3), each needed for the imports to succeed:
  # - dask before 2024.4.1 fails to import on Python 3.12.3 ("descriptor '__call__' for
  #   'type' objects doesn't apply to a 'property' object"), so download.txt pins dask and
  #   distributed 2024.4.2, kept on the legacy (non dask-expr) DataFrame that Merlin 23.8 knows;
  # - transformers 4.30 imports the machine's jax (built for numpy 2) and peft (which wants
  #   transformers 5): USE_* keeps transformers to torch, and download.txt pins peft 0.4.0.
  export DASK_DATAFRAME__QUERY_PLANNING="${DASK_DATAFRAME__QUERY_PLANNING:-False}"
  export USE_TF=0 USE_FLAX=0 USE_JAX=0 USE_TORCH=1
  hash -r

  [ "${T4R_SKIP_SMOKE:-0}" = 1 ] && return 0
  echo "device_setup: smoke test with $(command -v python3)"
  python3 -W ignore -c 'import merlin.systems, nvtabular, transformers4rec.torch, merlin_t4r_ops, tritonclient.grpc; import torch; print(torch.cuda.is_available())' || return 1
  python3 -W ignore - <<'EOF' || return 1
import importlib.metadata as md, os
import numpy, pandas, pyarrow, scipy, transformers, torch, dask, merlin.core, merlin.io
import merlin.dataloader, tritonclient.http
from merlin.core import compat
from merlin_t4r_ops.serving.triton_env import tritonserver_executable
print("numpy", numpy.__version__, "| pandas", pandas.__version__, "| pyarrow", pyarrow.__version__,
      "| scipy", scipy.__version__, "| dask", dask.__version__)
print("transformers", transformers.__version__, "| tokenizers dist", md.version("tokenizers"),
      "| torch", torch.__version__, "| numba", md.version("numba"))
print("dask convert-string", dask.config.get("dataframe.convert-string"))
print("merlin HAS_GPU", compat.HAS_GPU, "| cupy", compat.cupy, "| cudf", compat.cudf)
ts = tritonserver_executable()
print("tritonserver", ts, "executable" if os.access(ts, os.X_OK) else "NOT EXECUTABLE")
EOF
}

_t4r_setup
_t4r_rc=$?
unset -f _t4r_setup
if [ "$_t4r_rc" -ne 0 ]; then echo "device_setup: FAILED (rc $_t4r_rc)" >&2; fi
# shellcheck disable=SC2317
return "$_t4r_rc" 2>/dev/null || exit "$_t4r_rc"
