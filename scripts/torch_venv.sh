#!/usr/bin/env bash
# Creates ./.venv-torch with torch and numpy, for bench/torch_baselines.py only
# (bench/pipeline.py and bench/transformer.py use it by default when it
# exists). torch is no requirement of lingvo_ext; this venv is separate from
# .venv and gitignored.
# Installs the newest CPU-only torch wheel (version +cpu: 0.2 GB, 1 GB installed)
# that pip can find, else the default torch wheel (with its CUDA libraries,
# some GB).
# TORCH_SPEC overrides the choice, e.g. TORCH_SPEC='torch==2.13.0+cpu'.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv-torch"
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null || py=python3
if [ ! -x "$venv/bin/python" ]; then
  echo "torch venv: creating $venv" >&2
  "$py" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install -q --upgrade pip
spec="${TORCH_SPEC:-}"
if [ -z "$spec" ]; then
  # `pip index versions` lists newest first, local versions (+cpu) included.
  cpu="$("${pip[@]}" index versions torch 2>/dev/null |
         sed -n 's/^Available versions: //p' | tr ',' '\n' | tr -d ' ' |
         grep '+cpu$' | head -n 1 || true)"
  spec="torch${cpu:+==$cpu}"
fi
echo "torch venv: installing $spec" >&2
"${pip[@]}" install -q "$spec" numpy
"$venv/bin/python" -c 'import torch; print("torch venv: torch", torch.__version__)' >&2
