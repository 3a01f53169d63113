#!/usr/bin/env bash
# Runs the test suite (installs .venv first when needed). Extra args go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/venv.sh"
cd "$root"
exec "$root/.venv/bin/python" -m pytest "$@"
