#!/usr/bin/env bash
# Which ComfyUI the pack uses: the one rule, shared by scripts/install.sh, start-tp2.sh, demo.sh and the tests.
#
#   an explicit --comfyui DIR  >  $COMFYUI_DIR  >  the one scripts/install.sh remembered in <pack>/.comfyui-dir  >  ~/ComfyUI
#
# Sourced by the bash scripts (defines resolve_comfyui and remember_comfyui; sets no shell options: the caller's
# `set -euo pipefail` applies). Run directly with --print, it prints the directory and, on a second line, where it
# came from (the Python test harness reads that, so both sides follow the same rule).

COMFYUI_REMEMBERED_FILE="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/.comfyui-dir"

# resolve_comfyui [EXPLICIT]: sets COMFYUI (the directory, as given) and COMFYUI_FROM (where it came from)
resolve_comfyui() {
  if [[ -n "${1:-}" ]]; then
    COMFYUI="$1"; COMFYUI_FROM="--comfyui"
  elif [[ -n "${COMFYUI_DIR:-}" ]]; then
    COMFYUI="$COMFYUI_DIR"; COMFYUI_FROM="\$COMFYUI_DIR"
  elif [[ -s "$COMFYUI_REMEMBERED_FILE" ]]; then
    COMFYUI="$(head -n 1 "$COMFYUI_REMEMBERED_FILE")"; COMFYUI_FROM="remembered by scripts/install.sh in $COMFYUI_REMEMBERED_FILE"
  else
    COMFYUI="$HOME/ComfyUI"; COMFYUI_FROM="the default"
  fi
}

# remember_comfyui DIR: the ComfyUI set-up used, for every later command that is given none
remember_comfyui() {
  printf '%s\n' "$1" > "$COMFYUI_REMEMBERED_FILE"
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  set -euo pipefail
  [[ "${1:-}" == --print ]] || { echo "comfyui_dir.sh: source it, or run it with --print" >&2; exit 2; }
  resolve_comfyui "${2:-}"
  printf '%s\n%s\n' "$COMFYUI" "$COMFYUI_FROM"
fi
