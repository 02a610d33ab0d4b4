#!/usr/bin/env bash
# The GPU benchmark, run on a 2-GPU machine from the pack's folder (after scripts/bench/stage.sh made .device/):
#   bash scripts/bench.sh [bench_comfy.py options, e.g. --tp-sizes 1,2 --resolutions 832x480]
#   bash scripts/bench.sh --whole-video [whole_video.py options, e.g. --configs tp1,tp2 --fast]
# Unpacks ComfyUI and the missing packages into /tmp/tp2bench, writes a full-size random-weight int8 ConvRot H3
# checkpoint with the real key layout (scripts/make_tiny_h3.py --full-size --int8, ~20 GB) and a conditioning
# file, then runs TP1 and TP2 side by side (scripts/bench/bench_comfy.py). Results go to $OUT (or ./bench-out).
# --whole-video: instead, all four models of the bundled workflows at full size (scripts/bench/make_models.py,
# ~41 GB, kept in /tmp/tp2bench/base between calls) and the bundled T2V+audio workflow to an MP4 with real PyAV
# (scripts/bench/whole_video.py: per phase, cold and warm).
# --host-memory: the host-memory measurement of a 2 x 22 GiB pair, in up to three calls of this same command
# (scripts/bench/host_memory.sh says what it runs).
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
PACK_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
W=/tmp/tp2bench; OUTDIR="${OUT:-$PWD/bench-out}"; PY="${PYTHON:-python3}"
[[ -d "$PACK_DIR/.device" ]] || { echo "bench.sh: no .device/ (run scripts/bench/stage.sh first and carry .device)" >&2; exit 1; }
mkdir -p "$W/site" "$W/ComfyUI" "$W/fe" "$OUTDIR"
if [[ "$PACK_DIR" != "$W/pack" ]] && ! kill -0 "$(cat "$W/host_memory/run.pid" 2>/dev/null)" 2>/dev/null; then
  # run from a copy outside the checkout: the device machine replaces the checkout at its next command, which would pull
  # the files from under a run that outlives this one (--host-memory's did: every process it started later failed)
  rm -rf "$W/pack" && cp -a "$PACK_DIR" "$W/pack" && exec bash "$W/pack/scripts/bench.sh" "$@"
fi
PACK_DIR="$W/pack"
export W PY PACK_DIR
if [[ "${1:-}" == --host-memory ]] && kill -0 "$(cat "$W/host_memory/run.pid" 2>/dev/null)" 2>/dev/null; then
  exec bash "$PACK_DIR/scripts/bench/host_memory.sh" follow   # a later call: follow the run in flight, touch nothing
fi
t0=$(date +%s)
if [[ ! -d "$W/site/comfy_kitchen" ]]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$W/site" "$PACK_DIR"/.device/wheels/*.whl
  tar -C "$W/site" -xJf "$PACK_DIR/.device/comfy_kitchen.tar.xz"
  tar -C "$W/site" -xJf "$PACK_DIR/.device/av.tar.xz"   # real PyAV (stage.sh stages it): ComfyUI imports it at start-up
fi
rm -rf "$W/ComfyUI" && mkdir -p "$W/ComfyUI" && tar -C "$W/ComfyUI" -xJf "$PACK_DIR/.device/comfyui.tar.xz"
echo '<html><body>minimax-h3-tp2 benchmark</body></html>' > "$W/fe/index.html"
export PYTHONPATH="$W/site${PYTHONPATH:+:$PYTHONPATH}"
BASE="$W/base"; mkdir -p "$BASE/custom_nodes" "$BASE/models/diffusion_models" "$BASE/models/h3_conditioning"
ln -sfn "$PACK_DIR" "$BASE/custom_nodes/minimax-h3-tp2"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
"$PY" -c "import torch, comfy_kitchen; print('torch', torch.__version__, 'gpus', torch.cuda.device_count(), 'int8 attention', comfy_kitchen.int8_attention_is_available())"
if [[ "${1:-}" == --host-memory ]]; then mkdir -p "$W/host_memory"; exec bash "$PACK_DIR/scripts/bench/host_memory.sh" start; fi
if [[ "${1:-}" == --whole-video ]]; then
  shift
  "$PY" "$PACK_DIR/scripts/bench/make_models.py" --comfyui "$W/ComfyUI" --models "$BASE/models"
  echo "set-up took $(( $(date +%s) - t0 )) s"
  exec "$PY" "$PACK_DIR/scripts/bench/whole_video.py" --comfyui "$W/ComfyUI" --base "$BASE" --front-end "$W/fe" --out "$OUTDIR" "$@"
fi
if [[ "${TP2_BENCH_SMOKE:-1}" == 1 ]]; then
echo "== smoke: tiny checkpoint, TP1 and TP2, to catch set-up problems before the 20 GB checkpoint =="
"$PY" "$PACK_DIR/scripts/make_tiny_h3.py" "$BASE/models/diffusion_models/h3_tiny_int8.safetensors" --int8 --hidden 512 --heads 4 --ffn 1024 --text-dim 256
"$PY" "$PACK_DIR/scripts/make_tiny_h3.py" --conditioning "$BASE/models/h3_conditioning/h3_tiny_cond.safetensors" --text-dim 256
"$PY" "$PACK_DIR/scripts/bench/bench_comfy.py" --comfyui "$W/ComfyUI" --base "$BASE" --front-end "$W/fe" --out "$OUTDIR/smoke" \
  --ckpt h3_tiny_int8.safetensors --cond h3_tiny_cond.safetensors --resolutions 256x256 --memory-resolutions "" --frames 22 --steps 3 --tp-sizes 1,2
fi
CKPT="$BASE/models/diffusion_models/h3_full_int8.safetensors"
tp_sizes=$(printf '%s\n' "$@" | awk 'f { print; exit } $0 == "--tp-sizes" { f = 1 }')   # the whole model only where a configuration uses it
if [[ -z "$tp_sizes" ]] || tr ',' '\n' <<<"$tp_sizes" | grep -qv half; then
  [[ -f "$CKPT" ]] || "$PY" "$PACK_DIR/scripts/make_tiny_h3.py" "$CKPT" --full-size --int8
fi
HALF="$BASE/models/diffusion_models/h3_half_int8.safetensors"   # variant 'half': one TP2 rank's widths as a whole model
if [[ "$*" == *half* && ! -f "$HALF" ]]; then "$PY" "$PACK_DIR/scripts/make_tiny_h3.py" "$HALF" --full-size --int8 --heads 28 --ffn 7168; fi
"$PY" "$PACK_DIR/scripts/make_tiny_h3.py" --conditioning "$BASE/models/h3_conditioning/h3_full_cond.safetensors" --text-dim 5120 --tokens 256
echo "set-up took $(( $(date +%s) - t0 )) s"
"$PY" "$PACK_DIR/scripts/bench/bench_comfy.py" --comfyui "$W/ComfyUI" --base "$BASE" --front-end "$W/fe" --out "$OUTDIR" "$@"
