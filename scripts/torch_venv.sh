#!/usr/bin/env bash
# Creates ./.venv-torch with torch and numpy, for bench/torch_baselines.py only
# (bench/pipeline.py uses it by default when it exists). torch is no
# requirement of lingvo_ext; this venv is separate from .venv and gitignored.
# Downloads about 5 GB (PyPI's torch wheel and its CUDA libraries).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv-torch"
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null || py=python3
if [ ! -x "$venv/bin/python" ]; then
  echo "torch venv: creating $venv" >&2
  "$py" -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q torch numpy
"$venv/bin/python" -c 'import torch; print("torch venv: torch", torch.__version__)' >&2
