#!/usr/bin/env bash
# Install (scripts/setup.sh) and run the whole test suite; extra arguments go to pytest (e.g. -m "not slow").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python tools/reclaim_shm.py  # segments leaked by DeepSpeed runs before the engine stopped making them
exec .venv/bin/python -m pytest -q "$@"
