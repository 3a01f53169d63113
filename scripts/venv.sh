#!/usr/bin/env bash
# Creates ./.venv when missing and brings it up to date; a no-op when current.
# Sourced by scripts/train.sh and scripts/test.sh.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null || py=python3
stamp="$venv/.lingvo_ext-installed"
want="$(cat "$root"/requirements*.txt "$root"/constraints.txt | sha256sum | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ]; then
  echo "venv: creating $venv" >&2
  "$py" -m venv "$venv"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "venv: installing requirements" >&2
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q -r "$root/requirements.txt" -c "$root/constraints.txt"
  # Lingvo's metadata pulls in apache-beam and jupyter, which it never imports.
  "$venv/bin/python" -m pip install -q --no-deps -r "$root/requirements-nodeps.txt"
  echo "$want" > "$stamp"
fi
# Every console script pyproject.toml names is in the venv's bin/.
_HasScripts() {
  local name
  for name in $(sed -n '/^\[project.scripts\]/,/^\[/s/^\([a-z-]*\) *=.*/\1/p' \
                "$root/pyproject.toml"); do
    [ -x "$venv/bin/$name" ] || return 1
  done
}
# This checkout, installed editable (pyproject.toml): `import lingvo_ext`,
# `python -m lingvo_ext.trainer` and the lingvo-ext-* commands work from any
# directory. Skipped when the venv already imports this checkout's package.
if ! (cd / && "$venv/bin/python" -c '
import os, sys
from importlib.util import find_spec
root = os.path.realpath(sys.argv[1])
def Here(name):  # Where the package would be imported from (not importing it).
  spec = find_spec(name)
  return spec and os.path.dirname(os.path.dirname(os.path.realpath(spec.origin)))
# An install without the top-level `params` package (the experiments) reinstalls.
from importlib.metadata import distribution
top = distribution("lingvo_ext").read_text("top_level.txt").split()
sys.exit(0 if Here("lingvo_ext") == root and sorted(top) == ["lingvo_ext", "params"] else 1)' "$root" \
    2>/dev/null && _HasScripts); then
  echo "venv: installing $root (editable)" >&2
  "$venv/bin/python" -m pip install -q --no-deps -e "$root"
fi
# Does nothing where x_ops.so already loads.
(cd "$root" && "$venv/bin/python" -m lingvo_ext.tools.fix_x_ops >&2)
