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
# Does nothing where x_ops.so already loads.
(cd "$root" && "$venv/bin/python" -m lingvo_ext.tools.fix_x_ops >&2)
