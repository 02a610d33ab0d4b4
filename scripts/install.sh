#!/usr/bin/env bash
# Set up minimax-h3-tp2: a virtualenv with torch, ComfyUI's requirements and the pack's, and the pack linked
# into ComfyUI's custom_nodes. Idempotent: run it again to repair or update; it says what it did.
#
#   scripts/install.sh [--comfyui DIR] [--venv DIR] [--no-link] [--dev]
#
#   --comfyui DIR  the ComfyUI to use (default: $COMFYUI_DIR, else ~/ComfyUI; cloned at the pinned release
#                  when absent and the network allows)
#   --venv DIR     where the virtualenv goes (default: $TP2_VENV, else <pack>/.venv)
#   --no-link      do not link the pack into DIR/custom_nodes
#   --dev          also install the test tools (pytest, ruff, psutil; Debian's chromium for the browser test)
#
# Env: TP2_TORCH_SPEC overrides the torch packages (default: "torch==2.14.1 torchvision==0.29.1"; torchaudio
# 2.11.1 is added without deps, as ComfyUI 0.33 needs it only for imports on the H3 path).
set -euo pipefail

PACK_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
COMFYUI_RELEASE="v0.33.0"
COMFYUI_GIT="https://github.com/comfyanonymous/ComfyUI.git"
COMFYUI="${COMFYUI_DIR:-$HOME/ComfyUI}"
VENV="${TP2_VENV:-$PACK_DIR/.venv}"
LINK=1
DEV=0
TORCH_SPEC="${TP2_TORCH_SPEC:-torch==2.14.1 torchvision==0.29.1}"

while [[ $# -gt 0 ]]; do
  case "$1" in
    --comfyui) COMFYUI="$2"; shift 2 ;;
    --venv) VENV="$2"; shift 2 ;;
    --no-link) LINK=0; shift ;;
    --dev) DEV=1; shift ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done

say() { printf '[install] %s\n' "$*"; }
PY="${PYTHON:-python3}"

if [[ ! -x "$VENV/bin/python" ]]; then
  say "creating virtualenv $VENV"
  "$PY" -m venv "$VENV"
else
  say "virtualenv $VENV exists"
fi
VPY="$VENV/bin/python"
PIP=(pip_quiet install --disable-pip-version-check -q)
pip_quiet() {  # pip, minus the noise of local index mirrors that some machines configure
  "$VPY" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

if "$VPY" -c "import torch, torchvision, torchaudio" 2>/dev/null; then
  say "torch $("$VPY" -c 'import torch; print(torch.__version__)') already installed"
else
  say "installing $TORCH_SPEC (+ torchaudio 2.11.1)"
  # shellcheck disable=SC2086
  "${PIP[@]}" $TORCH_SPEC
  "${PIP[@]}" --no-deps "torchaudio==2.11.1"
fi

if [[ ! -f "$COMFYUI/main.py" ]]; then
  say "no ComfyUI at $COMFYUI; cloning $COMFYUI_RELEASE"
  if git clone --depth 1 --branch "$COMFYUI_RELEASE" "$COMFYUI_GIT" "$COMFYUI" 2>/dev/null; then
    say "cloned ComfyUI $COMFYUI_RELEASE into $COMFYUI"
  else
    say "could not clone ComfyUI (no network?): the pack's core installs, the ComfyUI parts need --comfyui DIR"
  fi
fi

if [[ -f "$COMFYUI/requirements.txt" ]]; then
  say "installing ComfyUI's requirements ($COMFYUI/requirements.txt)"
  "${PIP[@]}" -r "$COMFYUI/requirements.txt"
fi

say "installing the pack's dependencies"
"${PIP[@]}" "safetensors>=0.4" "numpy>=1.25" "aiohttp>=3.9" "comfy-kitchen>=0.2.31"
if [[ $DEV -eq 1 ]]; then
  say "installing test tools"
  "${PIP[@]}" "pytest>=8" "ruff>=0.6" "psutil>=5.9"
  if ! command -v chromium >/dev/null 2>&1; then  # the headless-browser test of the web UI path
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
      say "installing Debian's chromium for the browser test"
      (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
        || say "could not install chromium: the browser test will be skipped"
    else
      say "no chromium (install Debian's 'chromium' package): the browser test will be skipped"
    fi
  fi
fi

if [[ $LINK -eq 1 && -d "$COMFYUI/custom_nodes" ]]; then
  target="$COMFYUI/custom_nodes/minimax-h3-tp2"
  if [[ -L "$target" && "$(readlink -f "$target")" == "$PACK_DIR" ]]; then
    say "pack already linked at $target"
  elif [[ -e "$target" ]]; then
    say "WARNING: $target exists and is not a link to this pack; left as is"
  else
    ln -s "$PACK_DIR" "$target"
    say "linked the pack into $target"
  fi
fi

"$VPY" - <<'EOF'
import torch, comfy_kitchen, safetensors
print(f"[install] ready: torch {torch.__version__} (CUDA {'yes, %d GPU(s)' % torch.cuda.device_count() if torch.cuda.is_available() else 'no'}), "
      f"comfy-kitchen {getattr(comfy_kitchen, '__version__', '?')}, safetensors {safetensors.__version__}")
EOF
say "ComfyUI: $([[ -f "$COMFYUI/main.py" ]] && echo "$COMFYUI" || echo "none")"
say "python: $VPY"
