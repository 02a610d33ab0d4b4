#!/usr/bin/env bash
# Which ComfyUI and which Python the pack uses: the one rule, shared by scripts/install.sh, start-tp2.sh, demo.sh,
# tp2-submit, scripts/test and the tests.
#
#   ComfyUI: an explicit --comfyui DIR  >  $COMFYUI_DIR  >  the ComfyUI whose custom_nodes/ holds the pack  >
#            the one scripts/install.sh remembered in <pack>/.comfyui-dir  >  ~/ComfyUI
#   Python:  an explicit --python PATH  >  $PYTHON  >  that ComfyUI's venv/ or .venv/  >  the active virtualenv or
#            conda environment (with torch)  >  the pack's own .venv (scripts/install.sh)  >  python3
#
# Sourced by the bash scripts (defines resolve_comfyui, resolve_python, remember_comfyui; sets no shell options: the
# caller's `set -euo pipefail` applies). Run directly with --print [DIR], it prints the directory, where it came
# from, the Python and where that came from, a line each (the Python test harness and tp2-submit read them).

PACK_DIR="${PACK_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}"
COMFYUI_REMEMBERED_FILE="$PACK_DIR/.comfyui-dir"

# resolve_comfyui [EXPLICIT]: sets COMFYUI (the directory, as given) and COMFYUI_FROM (where it came from)
resolve_comfyui() {
  local above; above="$(dirname "$PACK_DIR")"
  if [[ -n "${1:-}" ]]; then
    COMFYUI="$1"; COMFYUI_FROM="--comfyui"
  elif [[ -n "${COMFYUI_DIR:-}" ]]; then
    COMFYUI="$COMFYUI_DIR"; COMFYUI_FROM="\$COMFYUI_DIR"
  elif [[ "$(basename "$above")" == custom_nodes && -f "$(dirname "$above")/main.py" ]]; then
    COMFYUI="$(dirname "$above")"; COMFYUI_FROM="the ComfyUI whose custom_nodes holds the pack"
  elif [[ -s "$COMFYUI_REMEMBERED_FILE" ]]; then
    COMFYUI="$(head -n 1 "$COMFYUI_REMEMBERED_FILE")"; COMFYUI_FROM="remembered by scripts/install.sh in $COMFYUI_REMEMBERED_FILE"
  else
    COMFYUI="$HOME/ComfyUI"; COMFYUI_FROM="the default"
  fi
}

# resolve_python [EXPLICIT]: sets PY and PY_FROM (needs COMFYUI: call resolve_comfyui first)
resolve_python() {
  local v env_py="${VIRTUAL_ENV:-${CONDA_PREFIX:-}}/bin/python"
  if [[ -n "${1:-}" ]]; then PY="$1" PY_FROM="--python"; return; fi
  if [[ -n "${PYTHON:-}" ]]; then PY="$PYTHON" PY_FROM="\$PYTHON"; return; fi
  for v in venv .venv; do
    [[ -x "$COMFYUI/$v/bin/python" ]] && { PY="$COMFYUI/$v/bin/python" PY_FROM="ComfyUI's own $v"; return; }
  done
  if [[ -n "${VIRTUAL_ENV:-}${CONDA_PREFIX:-}" && -x "$env_py" ]] && "$env_py" -c "import torch" 2>/dev/null; then
    PY="$env_py" PY_FROM="the active environment"; return
  fi
  if [[ -x "$PACK_DIR/.venv/bin/python" ]]; then PY="$PACK_DIR/.venv/bin/python" PY_FROM="the pack's .venv (scripts/install.sh)"; return; fi
  PY=python3 PY_FROM="python3 on PATH"
}

# remember_comfyui DIR: the ComfyUI set-up used, for every later command that is given none
remember_comfyui() {
  printf '%s\n' "$1" > "$COMFYUI_REMEMBERED_FILE"
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  set -euo pipefail
  [[ "${1:-}" == --print ]] || { echo "comfyui_dir.sh: source it, or run it with --print" >&2; exit 2; }
  resolve_comfyui "${2:-}"
  resolve_python
  printf '%s\n%s\n%s\n%s\n' "$COMFYUI" "$COMFYUI_FROM" "$PY" "$PY_FROM"
fi
