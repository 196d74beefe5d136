#!/usr/bin/env bash
# A real Triton Inference Server for the Triton-hosted verifier (specdec export-triton), from nothing:
# the `tritonserver` binary (2.51, Python backend) that PyPI's nvidia-pytriton ships, in its own
# virtual environment, made able to run specdec's verifier model.
#
#   deploy/triton/setup.sh [VENV]      (default VENV: .triton-venv in the repository, git-ignored)
#
# - numpy < 2: with numpy 2 the Python backend reads inputs wrong and returns empty outputs;
# - the Python 3.11 backend stub goes where the server looks for it (backends/python/);
# - the stub runs its own interpreter, the first `python3` on PATH (put VENV/bin first), and ignores
#   PYTHONPATH, so a .pth file in VENV's site-packages makes this checkout importable;
# - torch: the CPU wheel ($PIP_FIND_LINKS names its directory here); specdec's own dependencies.
# tests/triton/tritonserver.py starts the binary; SPECDEC_TRITON_VENV tells it where VENV is.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
venv="${1:-$repo/.triton-venv}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet "nvidia-pytriton==0.7.0" "numpy<2" "torch==2.13.0" \
  "sentencepiece>=0.2" "safetensors>=0.4" "structlog>=24.1"
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
triton="$site/pytriton/tritonserver"
version="$("$venv/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
cp "$triton/python_backend_stubs/$version/triton_python_backend_stub" "$triton/backends/python/"
echo "$repo" > "$site/specdec-checkout.pth"
"$venv/bin/python" -c "import numpy, torch, verifier_service.triton_model; assert numpy.__version__ < '2'"
echo "tritonserver: $triton/bin/tritonserver (venv $venv)"
