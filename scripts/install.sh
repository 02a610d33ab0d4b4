#!/usr/bin/env bash
# Set up minimax-h3-tp2: the pack's requirements in the Python your ComfyUI runs with (its venv/ or .venv/, when it
# has one with torch), else a virtualenv of the pack's own with torch, ComfyUI's requirements and the pack's; and
# the pack linked into ComfyUI's custom_nodes. Idempotent: run it again to repair or update; it says what it did.
#
#   scripts/install.sh [--comfyui DIR] [--venv DIR | --own-venv] [--no-link] [--dev]
#
#   --comfyui DIR  the ComfyUI to use (default: $COMFYUI_DIR, else the one remembered in <pack>/.comfyui-dir,
#                  else ~/ComfyUI; cloned at the pinned release when absent and the network allows). The ComfyUI
#                  used is remembered in <pack>/.comfyui-dir: start-tp2.sh, demo.sh and the tests use it when
#                  given no --comfyui and no $COMFYUI_DIR (scripts/lib/comfyui_dir.sh has the rule)
#   --venv DIR     where the virtualenv goes (default: $TP2_VENV, else ComfyUI's own venv/ or .venv/ when it has
#                  torch, else <pack>/.venv)
#   --own-venv     the pack's own <pack>/.venv even when ComfyUI has a virtualenv (a second torch, ~6.9 GB)
#   --no-link      do not link the pack into DIR/custom_nodes
#   --dev          also install the test tools (pytest, ruff, psutil) and, run as root where apt-get is, Debian's
#                  chromium system-wide for the browser test (apt-get install chromium)
#
# What is already there (torch, each requirement at a version that satisfies it, the link) is said so and left.
#
# Env: TP2_TORCH_SPEC overrides the torch packages (default: "torch==2.14.1 torchvision==0.29.1"; torchaudio
# 2.11.1 is added without deps, as ComfyUI 0.33 needs it only for imports on the H3 path). Without an NVIDIA driver
# (no nvidia-smi) torch's CPU build is tried first (download.pytorch.org/whl/cpu, ~0.2 GB instead of ~5.6 GB); where
# that index cannot be reached, the default build is installed.
set -euo pipefail

PACK_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
COMFYUI_RELEASE="v0.33.0"
COMFYUI_GIT="https://github.com/comfyanonymous/ComfyUI.git"
COMFYUI_ARG=""
VENV="${TP2_VENV:-$PACK_DIR/.venv}"
VENV_CHOSEN="${TP2_VENV:+1}"
OWN_VENV=0
LINK=1
DEV=0
TORCH_SPEC="${TP2_TORCH_SPEC:-torch==2.14.1 torchvision==0.29.1}"

while [[ $# -gt 0 ]]; do
  case "$1" in
    --comfyui) COMFYUI_ARG="$2"; shift 2 ;;
    --venv) VENV="$2"; VENV_CHOSEN=1; shift 2 ;;
    --own-venv) OWN_VENV=1; shift ;;
    --no-link) LINK=0; shift ;;
    --dev) DEV=1; shift ;;
    -h|--help) sed -n '2,/^set -euo pipefail/p' "$0" | sed -n 's/^# \{0,1\}//p'; exit 0 ;;
    *) echo "install.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done

say() { printf '[install] %s\n' "$*"; }
# shellcheck source=lib/comfyui_dir.sh
source "$PACK_DIR/scripts/lib/comfyui_dir.sh"
resolve_comfyui "$COMFYUI_ARG"
say "ComfyUI: $COMFYUI ($COMFYUI_FROM)"
PY="${PYTHON:-python3}"
REUSED=0  # the virtualenv is the one the user's ComfyUI runs with: its torch is used, never replaced
if [[ $OWN_VENV -eq 0 && -z "$VENV_CHOSEN" ]]; then
  for v in venv .venv; do
    if [[ -x "$COMFYUI/$v/bin/python" ]] && "$COMFYUI/$v/bin/python" -c "import torch" 2>/dev/null; then
      VENV="$COMFYUI/$v" REUSED=1
      say "using the Python your ComfyUI runs with ($VENV): no second torch (--own-venv makes the pack's own .venv instead)"
      break
    fi
  done
fi

free_gib() {  # GiB free on the filesystem holding $1 (or the nearest folder above it that exists)
  local d=$1; while [[ ! -e "$d" ]]; do d="$(dirname "$d")"; done
  df -Pk "$d" | awk 'NR == 2 { printf "%.1f", $4 / 1048576 }'
}
have_torch() { [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c "import torch, torchvision, torchaudio" 2>/dev/null; }
free="$(free_gib "$VENV")"
if [[ $REUSED -eq 0 ]] && ! have_torch && awk -v f="$free" 'BEGIN { exit !(f < 8) }'; then  # torch's CUDA build ~5.6 GB, ComfyUI's requirements ~1.3 GB
  say "ERROR: $free GiB free on the disk of $VENV; installing needs about 8 GiB (torch's CUDA build alone is ~5.6 GB)."
  say "Free some space there, or put the virtualenv on a disk with room: --venv DIR (or \$TP2_VENV)."
  exit 1
elif awk -v f="$free" 'BEGIN { exit !(f < 1.5) }'; then
  say "WARNING: only $free GiB free on the disk of $VENV: a missing requirement may not fit (ComfyUI's are ~1.3 GB in all)"
fi
say "disk: $free GiB free for $VENV"

if [[ ! -x "$VENV/bin/python" ]]; then
  say "creating virtualenv $VENV"
  "$PY" -m venv "$VENV"
else
  say "virtualenv $VENV: already there"
fi
VPY="$VENV/bin/python"
PIP=(pip_quiet install --disable-pip-version-check)  # pip's own lines show what it downloads (minutes, for torch)
[[ -t 1 ]] || PIP+=(--progress-bar off)  # into a pipe or a log: one line per download, no bars
pip_quiet() {  # pip, minus the noise of local index mirrors that some machines configure
  "$VPY" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

if [[ $REUSED -eq 1 ]]; then
  say "torch $("$VPY" -c 'import torch; print(torch.__version__)'): your ComfyUI's, left as it is"
elif have_torch; then
  say "torch $("$VPY" -c 'import torch; print(torch.__version__)'): already there"
else
  cpu_spec="$(sed -E 's/(==[0-9.]+)( |$)/\1+cpu\2/g' <<< "$TORCH_SPEC")"  # torch==2.14.1 -> torch==2.14.1+cpu
  # shellcheck disable=SC2086
  if [[ -z "${TP2_TORCH_SPEC:-}" ]] && ! command -v nvidia-smi >/dev/null 2>&1 \
    && say "no NVIDIA driver here (no nvidia-smi): trying torch's CPU build, $cpu_spec" \
    && "${PIP[@]}" --retries 1 --timeout 20 --index-url https://download.pytorch.org/whl/cpu $cpu_spec; then
    "${PIP[@]}" --retries 1 --timeout 20 --index-url https://download.pytorch.org/whl/cpu --no-deps "torchaudio==2.11.1+cpu" \
      || "${PIP[@]}" --no-deps "torchaudio==2.11.1"
  else
    [[ -n "${TP2_TORCH_SPEC:-}" ]] || command -v nvidia-smi >/dev/null 2>&1 || say "the CPU build could not be fetched: the default build instead"
    say "installing $TORCH_SPEC (+ torchaudio 2.11.1)"
    # shellcheck disable=SC2086
    "${PIP[@]}" $TORCH_SPEC
    "${PIP[@]}" --no-deps "torchaudio==2.11.1"
  fi
fi

if [[ ! -f "$COMFYUI/main.py" ]]; then
  say "no ComfyUI at $COMFYUI; cloning $COMFYUI_RELEASE"
  if git clone --depth 1 --branch "$COMFYUI_RELEASE" "$COMFYUI_GIT" "$COMFYUI" 2>/dev/null; then
    say "cloned ComfyUI $COMFYUI_RELEASE into $COMFYUI"
  else
    say "could not clone ComfyUI (no network?): the pack's core installs, the ComfyUI parts need --comfyui DIR"
  fi
fi
if [[ -f "$COMFYUI/main.py" ]]; then  # remembered for start-tp2.sh, demo.sh and the tests
  COMFYUI="$(cd "$COMFYUI" && pwd)"
  if [[ "$(head -n 1 "$COMFYUI_REMEMBERED_FILE" 2>/dev/null || true)" == "$COMFYUI" ]]; then
    say "ComfyUI remembered in $COMFYUI_REMEMBERED_FILE: already there"
  else
    remember_comfyui "$COMFYUI"
    say "remembered $COMFYUI in $COMFYUI_REMEMBERED_FILE (start-tp2.sh, demo.sh and the tests use it unless given --comfyui or \$COMFYUI_DIR)"
  fi
fi

missing() {  # requirement lines (arguments, or -r FILE): print the ones this virtualenv does not satisfy
  "$VPY" - "$@" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version

try:
    from packaging.requirements import InvalidRequirement, Requirement
except ImportError:  # pip always carries a copy
    from pip._vendor.packaging.requirements import InvalidRequirement, Requirement
lines = open(sys.argv[2]).read().splitlines() if sys.argv[1:2] == ["-r"] else sys.argv[1:]
for line in lines:
    line = line.split("#", 1)[0].strip()
    if not line:
        continue
    try:
        req = Requirement(line)
    except InvalidRequirement:  # an option or a URL: pip decides
        print(line)
        continue
    if req.marker is not None and not req.marker.evaluate():
        continue
    try:
        if not req.specifier.contains(version(req.name), prereleases=True):
            print(line)
    except PackageNotFoundError:
        print(line)
EOF
}
need() {  # WHAT PIP-ARGS...: install them unless every requirement is satisfied already, and say which it was
  local what=$1 todo; shift
  todo="$(missing "$@" | paste -sd ' ' -)" || todo="(could not check: $VPY failed)"
  if [[ -z "$todo" ]]; then say "$what: already there"; return 0; fi
  say "installing $what (missing or too old: $todo)"
  "${PIP[@]}" "$@"
}

if [[ -f "$COMFYUI/requirements.txt" ]]; then
  need "ComfyUI's requirements ($COMFYUI/requirements.txt)" -r "$COMFYUI/requirements.txt"
fi

need "the pack's dependencies" -r "$PACK_DIR/requirements.txt"
if [[ $DEV -eq 1 ]]; then
  need "test tools" "pytest>=8" "ruff>=0.6" "psutil>=5.9"
  if command -v chromium >/dev/null 2>&1; then
    say "chromium (the browser test): already there"
  else  # the headless-browser test of the web UI path
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
      say "installing Debian's chromium system-wide (apt-get install chromium) for the browser test"
      (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
        || say "could not install chromium: the browser test will be skipped"
    else
      say "no chromium (install Debian's 'chromium' package): the browser test will be skipped"
    fi
  fi
fi

if [[ $LINK -eq 1 && -d "$COMFYUI/custom_nodes" ]]; then
  target="$COMFYUI/custom_nodes/minimax-h3-tp2"
  if [[ "$(dirname "$PACK_DIR")" -ef "$COMFYUI/custom_nodes" ]]; then  # cloned there (the ComfyUI-Manager way)
    say "the pack sits in $COMFYUI/custom_nodes itself: nothing to link"
  elif [[ -L "$target" && "$(readlink -f "$target")" == "$PACK_DIR" ]]; then
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
from importlib.metadata import version
print(f"[install] ready: torch {torch.__version__} (CUDA {'yes, %d GPU(s)' % torch.cuda.device_count() if torch.cuda.is_available() else 'no'}), "
      f"comfy-kitchen {version('comfy-kitchen')}, safetensors {safetensors.__version__}")
EOF
say "ComfyUI: $([[ -f "$COMFYUI/main.py" ]] && echo "$COMFYUI" || echo "none")"
say "python: $VPY"
