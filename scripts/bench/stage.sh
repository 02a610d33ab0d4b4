#!/usr/bin/env bash
# Build .device/ (git-ignored) for the GPU benchmark: what the device image lacks for ComfyUI 0.33, trimmed to
# travel in one call (< 64 MiB): ComfyUI's source (no tests, API nodes, blueprints), comfy-kitchen's CUDA build
# (no HIP backend) for Python 3.12, real PyAV, and the small pure/compiled wheels ComfyUI imports at start-up.
#   scripts/bench/stage.sh [--comfyui DIR]
set -euo pipefail
PACK_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
COMFYUI="${COMFYUI_DIR:-$HOME/ComfyUI}"
[[ "${1:-}" == --comfyui ]] && COMFYUI="$2"
OUT="$PACK_DIR/.device"; rm -rf "$OUT"; mkdir -p "$OUT/wheels" "$OUT/tmp"
dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$1" "$2" 2> >(grep -v "is ignored" >&2); }
for p in comfy-aimdo==0.4.13 alembic sqlalchemy greenlet mako pydantic==2.14.4 pydantic-core==2.50.5 pydantic-settings \
         annotated-types typing-inspection python-dotenv torchsde trampoline blake3 simpleeval; do dl "$OUT/wheels" "$p"; done
dl "$OUT/tmp" comfy-kitchen==0.2.31
dl "$OUT/tmp" av   # real PyAV for the MP4s of the whole-video benchmark: unpacked and xz'd (~24 MB, the wheel is 35)
( mkdir "$OUT/tmp/av" && cd "$OUT/tmp/av" && unzip -q ../av-*.whl && tar -cf - . | xz -9e -T0 > "$OUT/av.tar.xz" )
( cd "$OUT/tmp" && unzip -q comfy_kitchen-*.whl && rm -rf comfy_kitchen/backends/hip comfy_kitchen-*.whl \
  && tar -cJf "$OUT/comfy_kitchen.tar.xz" comfy_kitchen comfy_kitchen-*.dist-info )
# anchored excludes: a bare "models" would also drop comfy/ldm/models
tar -C "$COMFYUI" --exclude=./.git --exclude=./tests --exclude=./tests-unit --exclude=./comfy_api_nodes --exclude=./blueprints \
    --exclude=./custom_nodes --exclude=./models --exclude=./output --exclude=./input --exclude=./user --exclude=./temp \
    --exclude='__pycache__' -cJf "$OUT/comfyui.tar.xz" .
rm -rf "$OUT/tmp"
du -sh "$OUT"/* | sort -h
echo "total: $(du -sm "$OUT" | cut -f1) MiB (a device call carries at most 64 MiB with the repository)"
