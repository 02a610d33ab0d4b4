#!/usr/bin/env bash
# The first TP run, no downloads: a synthetic H3 checkpoint and conditioning made locally, two ranks started
# (on two GPUs when there are two, else on the CPU), the tiny workflow submitted to both, outputs verified
# byte-identical across ranks (two latents and a 5-frame animated WEBP, whose path it prints), ranks stopped.
#
#   scripts/demo.sh [--comfyui DIR] [--base-port N] [--run-dir DIR] [--cpu]
#
#   --comfyui DIR  the ComfyUI to run (else scripts/lib/comfyui_dir.sh's rule: $COMFYUI_DIR, the ComfyUI whose
#                  custom_nodes holds the pack, the one scripts/install.sh remembered, ~/ComfyUI); its Python likewise
#   --base-port N  rank 0's HTTP port; rank 1 gets N + 1 (default: $TP2_DEMO_PORT, else 18288)
#   --run-dir DIR  the ranks' logs, outputs and the downloaded results (default: ./tp2-demo)
#   --cpu          both ranks on the CPU even when there are two GPUs
#
# The tiny files stay in that ComfyUI's models folders afterwards, where the bundled tiny workflow
# (workflows/h3_tp2_tiny_demo.json) finds them: models/diffusion_models/h3_tiny_int8.safetensors,
# models/h3_conditioning/h3_tiny_cond.safetensors and models/vae/h3_tiny_vae.safetensors. The ranks themselves
# run from RUN_DIR/base (only this pack as a custom node, the tiny files linked in), so your other custom nodes and
# models play no part.
set -euo pipefail
PACK_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
die() { echo "demo.sh: $*" >&2; exit 1; }
COMFYUI_ARG=""; RUN_DIR="$PWD/tp2-demo"; FORCE_CPU=0; BASE_PORT="${TP2_DEMO_PORT:-18288}"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --comfyui) COMFYUI_ARG="$2"; shift 2 ;;
    --base-port) BASE_PORT="$2"; shift 2 ;;
    --run-dir) RUN_DIR="$2"; shift 2 ;;
    --cpu) FORCE_CPU=1; shift ;;
    -h|--help) sed -n '2,/^set -euo pipefail/p' "$0" | sed -n 's/^# \{0,1\}//p'; exit 0 ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
done
[[ "$BASE_PORT" =~ ^[0-9]+$ && $BASE_PORT -ge 1 && $BASE_PORT -le 65534 ]] || die "--base-port must be a port number (1-65534), got '$BASE_PORT'"
# shellcheck source=lib/comfyui_dir.sh
source "$PACK_DIR/scripts/lib/comfyui_dir.sh"
resolve_comfyui "$COMFYUI_ARG"
echo "ComfyUI: $COMFYUI ($COMFYUI_FROM)"
[[ -f "$COMFYUI/main.py" ]] || die "no ComfyUI at '$COMFYUI' ($COMFYUI_FROM): give --comfyui DIR, or run $PACK_DIR/scripts/install.sh --comfyui DIR"
COMFYUI="$(cd "$COMFYUI" && pwd)"
resolve_python
echo "Python: $PY ($PY_FROM)"
"$PY" -c "import torch, safetensors, comfy_kitchen" 2>/dev/null \
  || die "$PY ($PY_FROM) lacks torch, safetensors or comfy_kitchen: run $PACK_DIR/scripts/install.sh (it installs the pack's requirements into the Python your ComfyUI runs with)"
mkdir -p "$RUN_DIR"; RUN_DIR="$(cd "$RUN_DIR" && pwd)"

echo "1/4 synthetic H3 checkpoint, conditioning and VAE, in $COMFYUI/models"
CKPT="$COMFYUI/models/diffusion_models/h3_tiny_int8.safetensors"
COND="$COMFYUI/models/h3_conditioning/h3_tiny_cond.safetensors"
VAE="$COMFYUI/models/vae/h3_tiny_vae.safetensors"
mkdir -p "$(dirname "$CKPT")" "$(dirname "$COND")" "$(dirname "$VAE")" || die "cannot write into $COMFYUI/models: use a ComfyUI you can write to (--comfyui DIR)"
# written under a temporary name and moved, so a stopped or failed demo never leaves half a file among the models
trap 'rm -f "$CKPT".part* "$COND".part* "$VAE".part*' EXIT
"$PY" "$PACK_DIR/scripts/make_tiny_h3.py" "$CKPT.part" --int8 || die "making the tiny checkpoint failed (above)"
mv -f "$CKPT.part" "$CKPT"
"$PY" "$PACK_DIR/scripts/make_tiny_h3.py" --conditioning "$COND.part" || die "making the tiny conditioning failed (above)"
mv -f "$COND.part" "$COND"
"$PY" "$PACK_DIR/scripts/make_tiny_h3.py" --vae "$VAE.part" || die "making the tiny VAE failed (above)"
mv -f "$VAE.part" "$VAE"
BASE="$RUN_DIR/base"
mkdir -p "$BASE/custom_nodes" "$BASE/models/diffusion_models" "$BASE/models/h3_conditioning" "$BASE/models/vae" "$BASE/input"
ln -sfn "$PACK_DIR" "$BASE/custom_nodes/minimax-h3-tp2"
ln -sfn "$CKPT" "$BASE/models/diffusion_models/h3_tiny_int8.safetensors"
ln -sfn "$COND" "$BASE/models/h3_conditioning/h3_tiny_cond.safetensors"
ln -sfn "$VAE" "$BASE/models/vae/h3_tiny_vae.safetensors"

where=(--cpu)
if [[ $FORCE_CPU -eq 0 ]] && [[ "$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)" -ge 2 ]]; then where=(--gpus 0,1); fi
echo "2/4 starting 2 ranks (${where[*]}) on ports $BASE_PORT and $((BASE_PORT + 1))"
trap '"$PACK_DIR/scripts/start-tp2.sh" stop --run-dir "$RUN_DIR/ranks" >/dev/null 2>&1 || true' EXIT
PYTHON="$PY" "$PACK_DIR/scripts/start-tp2.sh" --comfyui "$COMFYUI" --tp-size 2 "${where[@]}" --run-dir "$RUN_DIR/ranks" \
  --base-dir "$BASE" --base-port "$BASE_PORT" -- --disable-api-nodes
echo "3/4 submitting workflows/api/h3_tp2_tiny_demo.json to both ranks"
"$PY" "$PACK_DIR/scripts/tp2-submit" "$PACK_DIR/workflows/api/h3_tp2_tiny_demo.json" --run-dir "$RUN_DIR/ranks" --out "$RUN_DIR/outputs" --timeout 600
echo "4/4 verified: both ranks wrote identical files (above). Stopping the ranks."
webps=("$RUN_DIR/outputs/rank0"/h3_tiny_demo_*.webp)
echo "The video (the tiny model's latent through a small random VAE, so coloured noise): ${webps[-1]}"
echo "The tiny model stays in $COMFYUI/models (diffusion_models/h3_tiny_int8.safetensors, h3_conditioning/h3_tiny_cond.safetensors,"
echo "vae/h3_tiny_vae.safetensors): workflows/h3_tp2_tiny_demo.json runs from rank 0's UI after scripts/start-tp2.sh too."
