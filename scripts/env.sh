# Sourced by the scripts in this folder: make sure ./.venv holds the project, then activate it.
# The venv is built once; delete .venv to rebuild it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if [ ! -x "$ROOT/.venv/bin/python" ] || [ ! -f "$ROOT/.venv/.installed" ] \
   || [ "$ROOT/constraints.txt" -nt "$ROOT/.venv/.installed" ] \
   || [ "$ROOT/setup.cfg" -nt "$ROOT/.venv/.installed" ]; then
  echo "setting up $ROOT/.venv with $($PYTHON --version)" >&2
  "$PYTHON" -m venv "$ROOT/.venv"
  # pip 25 refuses merlin-systems 23.8's direct-URL test extra; 24.0 installs it.
  "$ROOT/.venv/bin/python" -m pip install -q "pip==24.0"
  "$ROOT/.venv/bin/python" -m pip install -q -c "$ROOT/constraints.txt" -e "$ROOT[test]"
  touch "$ROOT/.venv/.installed"
fi
# shellcheck disable=SC1091
source "$ROOT/.venv/bin/activate"
cd "$ROOT"
