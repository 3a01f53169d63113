#!/usr/bin/env bash
# Trains the default model (installs .venv first when needed). Extra args are
# passed on, e.g. scripts/train.sh --max_steps=100.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/venv.sh"
cd "$root"
exec "$root/.venv/bin/python" -m lingvo_ext.examples.gpipe_example "$@"
