#!/usr/bin/env bash
# The pure-Python packages experiments/gpu_check.sh needs that the GPU machine's image lacks
# (hydra-core, omegaconf, antlr4-python3-runtime), built as wheels into .whl/ (git-ignored) at the
# versions of this checkout's .venv. Run it here, where PyPI is reachable; carry .whl to the GPU.
#
#   experiments/gpu_wheels.sh [PYTHON]          # default: .venv/bin/python
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
specs=$("$PY" -c "from importlib.metadata import version as v
print(' '.join(f'{n}=={v(n)}' for n in ('hydra-core', 'omegaconf', 'antlr4-python3-runtime')))")
mkdir -p .whl
"$PY" -m pip wheel -q --no-deps -w .whl $specs
ls .whl
