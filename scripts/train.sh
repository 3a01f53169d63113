#!/usr/bin/env bash
# Trains the default experiment, lm.TransformerLm, on the English text that
# ships with Python (installs .venv first when needed). Extra args go to the
# trainer, e.g. scripts/train.sh --max_steps=200, or
# scripts/train.sh --model=lm.TransformerLmGPipe --num_cpu_devices=2 --worker_split_size=2
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/venv.sh"
cd "$root"
logdir="${LOGDIR:-/tmp/lingvo_ext/lm}"
echo "train: logdir $logdir; watch it with: .venv/bin/tensorboard --logdir=$logdir" >&2
exec "$root/.venv/bin/python" -m lingvo_ext.trainer --model=lm.TransformerLm \
  --logdir="$logdir" "$@"
