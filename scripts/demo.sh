#!/usr/bin/env bash
# The first TP run, no downloads: a synthetic H3 checkpoint and conditioning made locally, two ranks started
# (on two GPUs when there are two, else on the CPU), the tiny workflow submitted to both, outputs verified
# byte-identical across ranks, ranks stopped.
#
#   scripts/demo.sh [--comfyui DIR] [--run-dir DIR] [--cpu]
set -euo pipefail
PACK_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
COMFYUI="${COMFYUI_DIR:-$HOME/ComfyUI}"; RUN_DIR="$PWD/tp2-demo"; FORCE_CPU=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --comfyui) COMFYUI="$2"; shift 2 ;;
    --run-dir) RUN_DIR="$2"; shift 2 ;;
    --cpu) FORCE_CPU=1; shift ;;
    -h|--help) sed -n '2,7p' "$0"; exit 0 ;;
    *) echo "demo.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done
PY="${PYTHON:-$PACK_DIR/.venv/bin/python}"
[[ -x "$PY" ]] || { echo "demo.sh: no $PY; run scripts/install.sh first" >&2; exit 1; }
BASE="$RUN_DIR/base"
mkdir -p "$BASE/custom_nodes" "$BASE/models/diffusion_models" "$BASE/models/h3_conditioning" "$BASE/input"
ln -sfn "$PACK_DIR" "$BASE/custom_nodes/minimax-h3-tp2"
echo "1/4 synthetic H3 checkpoint and conditioning"
"$PY" "$PACK_DIR/scripts/make_tiny_h3.py" "$BASE/models/diffusion_models/h3_tiny_int8.safetensors" --int8
"$PY" "$PACK_DIR/scripts/make_tiny_h3.py" --conditioning "$BASE/models/h3_conditioning/h3_tiny_cond.safetensors"

where=(--cpu)
if [[ $FORCE_CPU -eq 0 ]] && [[ $(nvidia-smi -L 2>/dev/null | wc -l) -ge 2 ]]; then where=(--gpus 0,1); fi
echo "2/4 starting 2 ranks (${where[*]})"
trap '"$PACK_DIR/scripts/start-tp2.sh" stop --run-dir "$RUN_DIR/ranks" >/dev/null 2>&1 || true' EXIT
PYTHON="$PY" "$PACK_DIR/scripts/start-tp2.sh" --comfyui "$COMFYUI" --tp-size 2 "${where[@]}" --run-dir "$RUN_DIR/ranks" \
  --base-dir "$BASE" --base-port "${TP2_DEMO_PORT:-18288}" -- --disable-api-nodes
echo "3/4 submitting workflows/api/h3_tp2_tiny_demo.json to both ranks"
"$PY" "$PACK_DIR/scripts/tp2-submit" "$PACK_DIR/workflows/api/h3_tp2_tiny_demo.json" --run-dir "$RUN_DIR/ranks" --out "$RUN_DIR/outputs" --timeout 600
echo "4/4 verified: both ranks wrote identical files (above). Stopping the ranks."
