#!/usr/bin/env bash
# Start, stop or inspect one ComfyUI per GPU, joined into one tensor-parallel world by minimax-h3-tp2.
#
#   scripts/start-tp2.sh [--comfyui DIR] [--python PATH] [--tp-size N] [--split 3:2 | auto] [--gpus 0,1 | --cpu] [--fast] [--lean-memory]
#                        [--pin-weights] [--ckpt NAME] [--base-port 18188]
#                        [--run-dir DIR] [--base-dir DIR] [--listen ADDR --allow-remote] [-- extra ComfyUI args]
#   scripts/start-tp2.sh stop    --run-dir DIR
#   scripts/start-tp2.sh status  --run-dir DIR
#   scripts/start-tp2.sh restart --run-dir DIR --rank N
#   scripts/start-tp2.sh check   [--tp-size N] [--gpus 0,1 | --cpu] [--split S]   will it run, how fast (no ComfyUI started)
#
# Each rank r gets CUDA_VISIBLE_DEVICES=<its GPU>, HTTP port base-port + r, and its own output, temp, user
# directories and sqlite database under the run dir (default ./tp2-run); logs are RUN_DIR/rank<r>.log and the
# pids RUN_DIR/pids, the per-run secret RUN_DIR/secret (rank 0 hands every prompt it starts to the followers,
# authenticated with it). Followers start first; the command returns once every rank answers its HTTP API; Ctrl-C (or
# TERM) before that stops the ranks it started, naming each.
# A rank whose process exits is started again (at most TP2_MAX_RESTARTS times in a row; RUN_DIR/rank<r>.restarts
# says when and why, and `status` shows it); the ranks form a new group at the next prompt. `restart --rank N`
# restarts one rank by hand.
# --comfyui DIR: else $COMFYUI_DIR, else the ComfyUI whose custom_nodes holds the pack, else the one scripts/install.sh
# remembered, else ~/ComfyUI (it says which).
# Before any rank starts, tp_size is checked (as `python -m tp2.inspect` does) against --ckpt NAME (a file in
# models/diffusion_models or models/unet, or a path), else against every MiniMax-H3 file in those folders; a
# tp_size that no such file can be split into is refused with the sizes that work. The MiniMax-H3 text encoders in
# models/text_encoders and models/clip are checked the same way.
# --split 3:2 gives each rank that share of the split layers (attention heads, FFN columns, the text encoder's KV
# heads, the VAE decode's tiles), rank 0 first: for GPUs of different memory or speed. Omitted: the even split.
# --split auto measures each GPU (free memory, and the time of one H3-shaped block: scripts/lib/balance.py) and
# chooses the shares before any rank starts; the decision is printed and written to RUN_DIR/split.
# --base-dir passes ComfyUI's --base-directory (models and custom_nodes from there; the demo uses it).
# --fast starts with the fastest measured settings (bf16 reduce, sequence parallelism, fused Triton kernels; about
# 1.9x one GPU at 832x480 on 2x H200, docs/PERFORMANCE.md) instead of the exact defaults; a variable set in the
# environment still wins. ComfyUI runs under the Python of scripts/lib/comfyui_dir.sh's rule (--python PATH, $PYTHON,
# ComfyUI's venv/ or .venv/, the active environment, the pack's .venv); it is checked for what the pack needs
# (torch, comfy-kitchen's int8 kernels, ComfyUI with H3) before any rank starts.
# --lean-memory: torch's own CUDA allocator (ComfyUI's --disable-cuda-malloc) instead of ComfyUI's cudaMallocAsync: for
# the longest videos on small cards (at 1920x1088x362 a rank's pool held 1.24x its 14.1 GiB of tensors where
# cudaMallocAsync held ~1.39x; the same speed, docs/PERFORMANCE.md). Without expandable segments:
# dynamic VRAM frees weights only for allocations made by cudaMalloc/cudaMallocAsync, which those bypass.
# Each rank starts with ComfyUI's --disable-pinned-memory: its weights stay in the mapped files (rank cache, VAEs) instead
# of a page-locked copy per process (832x480x124 on one H100, each rank on its own 22 GiB: 3.0 GiB private host memory a
# rank instead of 24.5, the warm prompt 2% slower on a 64 GB host; 1920x1088x124 ran, where with the copies both ranks
# ran out of GPU memory; docs/PERFORMANCE.md). --pin-weights keeps ComfyUI's pinned copies, with torch's native allocator:
# with them cudaMallocAsync's pool held 20.8 GiB for 7 GiB of tensors at 1920x1088x124 on 22 GiB and ran out (freed
# blocks parked in the pool, the likely cause: dynamic VRAM cannot evict them; the native allocator empties its cache
# and retries. Predicted to fit; not yet run on a GPU).
set -euo pipefail

LEAN_MEMORY=0; PIN_WEIGHTS=0
for a in "$@"; do  # --fast changes the defaults below, so it is read first
  [[ "$a" == -- ]] && break
  [[ "$a" == --fast ]] && : "${TP2_REDUCE_DTYPE:=bf16}" "${TP2_SEQUENCE_PARALLEL:=1}" "${TP2_SP_FUSED_NORM:=1}"
  [[ "$a" == --lean-memory ]] && LEAN_MEMORY=1
  [[ "$a" == --pin-weights ]] && PIN_WEIGHTS=1 && LEAN_MEMORY=1  # the native allocator: see above
done

# ---- defaults: the one place they live (each can be overridden by the same env var) ----
: "${TP2_INT8_KERNEL:=auto}"         # int8 GEMM of row-parallel layers: auto | cuda | triton | eager
: "${TP2_ATTN_BACKEND:=auto}"        # attention: auto (measured once per GPU) | ck | sdpa
: "${TP2_TIMEOUT_S:=300}"            # a collective waits this long for a peer before it is an error
: "${TP2_PROMPT_TIMEOUT_S:=45}"      # ranks wait this long for each other at every sampler
: "${TP2_START_TIMEOUT_S:=300}"      # start-up: how long to wait for every rank's HTTP API
: "${TP2_MAX_RESTARTS:=5}"          # a rank that exits is started again at most this many times in a row
: "${TP2_REDUCE_DTYPE:=fp32}"        # row-parallel reduce: fp32 (exact sums) | bf16 (faster, see docs/PERFORMANCE.md)
: "${TP2_SEQUENCE_PARALLEL:=0}"      # 1: DiT blocks split the token rows too (bit-identical, a little faster)
: "${TP2_SP_INT8_GATHER:=1}"         # with sequence parallelism: int8 linears' inputs gathered as int8 (bit-identical)
: "${TP2_SP_FUSED_NORM:=0}"          # with sequence parallelism on CUDA: norm + modulation as one Triton kernel (faster)
: "${TP2_PARALLEL_VAE:=1}"           # 1: the video VAE decode is split over the ranks
export TP2_INT8_KERNEL TP2_ATTN_BACKEND TP2_TIMEOUT_S TP2_PROMPT_TIMEOUT_S TP2_REDUCE_DTYPE TP2_SEQUENCE_PARALLEL TP2_SP_INT8_GATHER TP2_SP_FUSED_NORM TP2_PARALLEL_VAE

PACK_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
die() { echo "start-tp2: $*" >&2; exit 1; }
case "$(uname -s)" in  # Git Bash, MSYS2 and Cygwin run this script on native Windows, where the pack cannot run
  MINGW*|MSYS*|CYGWIN*) die "native Windows is not supported (the pack needs Linux: NCCL, fcntl); run ComfyUI and this launcher inside WSL2 (untested) or on Linux" ;;
esac

cmd=start
if [[ $# -gt 0 && ( "$1" == stop || "$1" == status || "$1" == restart || "$1" == check || "$1" == _supervise ) ]]; then cmd=$1; shift; fi
RANK_ARG=""
COMFYUI_ARG=""; CKPT=""; TP_SIZE=2; SPLIT="${TP2_SPLIT:-}"; GPUS=""; CPU=0; BASE_PORT=18188; RUN_DIR="$PWD/tp2-run"; BASE_DIR=""
LISTEN=127.0.0.1; ALLOW_REMOTE=0; EXTRA=(); PYTHON_ARG=""
need() { [[ $# -ge 2 && "$2" != --* ]] || die "$1 needs a value (see --help)"; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --comfyui) need "$@"; COMFYUI_ARG="$2"; shift 2 ;;
    --ckpt) need "$@"; CKPT="$2"; shift 2 ;;
    --tp-size) need "$@"; TP_SIZE="$2"; shift 2 ;;
    --split) need "$@"; SPLIT="$2"; shift 2 ;;
    --gpus) need "$@"; GPUS="$2"; shift 2 ;;
    --cpu) CPU=1; shift ;;
    --fast|--lean-memory|--pin-weights) shift ;;  # read above
    --base-port) need "$@"; BASE_PORT="$2"; shift 2 ;;
    --run-dir) need "$@"; RUN_DIR="$2"; shift 2 ;;
    --base-dir) need "$@"; BASE_DIR="$2"; shift 2 ;;
    --listen) need "$@"; LISTEN="$2"; shift 2 ;;
    --allow-remote) ALLOW_REMOTE=1; shift ;;
    --rank) need "$@"; RANK_ARG="$2"; shift 2 ;;
    --python) need "$@"; PYTHON_ARG="$2"; shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    -h|--help) sed -n '2,/^set -euo pipefail/p' "$0" | sed -n 's/^# \{0,1\}//p'; exit 0 ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
done
if [[ "$cmd" == start ]]; then
  RUN_DIR="$(mkdir -p "$RUN_DIR" && cd "$RUN_DIR" && pwd)"
elif [[ -d "$RUN_DIR" ]]; then  # stop, status, restart: read a run dir, never make one
  RUN_DIR="$(cd "$RUN_DIR" && pwd)"
fi
PIDS="$RUN_DIR/pids"
# a pack script as a command that works from here
pack_cmd() { if [[ "$PWD" == "$PACK_DIR" ]]; then echo "scripts/$1"; else echo "$PACK_DIR/scripts/$1"; fi; }

alive() {  # running, and not a zombie waiting for a parent that is gone (no fork: a Ctrl-C would end the child)
  local st; { read -r st < "/proc/$1/stat"; } 2>/dev/null || return 1
  st="${st##*) }"; [[ "${st:0:1}" != Z ]]
}
answers() { "$PY" - "$1" <<'EOF' 2>/dev/null
import sys, urllib.request
urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/system_stats", timeout=2).read()
EOF
}
port_free() {  # PORT [ADDR]: nothing listens on it (sockets in TIME-WAIT do not count: the servers bind with SO_REUSEADDR)
  "$PY" -c 'import socket, sys; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[2], int(sys.argv[1])))' \
    "$1" "${2:-127.0.0.1}" 2>/dev/null
}
PY="${PYTHON:-}"  # for stop/status; a start chooses again once it knows ComfyUI (resolve_python)
[[ -z "$PY" && -x "$PACK_DIR/.venv/bin/python" ]] && PY="$PACK_DIR/.venv/bin/python"
[[ -z "$PY" ]] && PY=python3

check_python() {  # before any rank starts: this Python has what the pack needs, else say what to install
  local missing
  [[ -f "$COMFYUI/comfy/ldm/minimax/model.py" ]] \
    || die "$COMFYUI has no MiniMax-H3 support (comfy/ldm/minimax/model.py): update ComfyUI (git -C $COMFYUI pull), or give --comfyui DIR"
  missing="$("$PY" - "$CPU" 2>/dev/null <<'EOF'
import importlib.util, sys
gone = [m for m in ("torch", "safetensors", "numpy", "aiohttp", "comfy_kitchen") if importlib.util.find_spec(m) is None]
if gone:
    print(", ".join(gone))
    sys.exit(0)
import comfy_kitchen, torch
if not hasattr(comfy_kitchen, "int8_linear"):
    print(f"comfy_kitchen with the int8 kernels (this one is {getattr(comfy_kitchen, '__version__', 'older')})")
elif sys.argv[1] == "0" and not torch.cuda.is_available():
    print(f"NOGPU torch {torch.__version__}")
EOF
)" || missing="a Python that runs (it failed: run $PY -c 'import torch, comfy_kitchen' to see why)"
  if [[ "$missing" == NOGPU* ]]; then
    command -v nvidia-smi >/dev/null 2>&1 || die "--gpus ${GPUS}: there is no GPU here (no nvidia-smi: no NVIDIA driver); use --cpu for a (slow) CPU run"
    die "${missing#NOGPU } under $PY sees no GPU (a CPU build of torch, or CUDA_VISIBLE_DEVICES hides them; nvidia-smi -L lists $(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')): install a CUDA build of torch there, or use --cpu"
  fi
  [[ -z "$missing" ]] || die "$PY ($PY_FROM) lacks $missing: install the pack's requirements into it ($PY -m pip install -r $PACK_DIR/requirements.txt), or choose another with --python PATH"
}

tail_log() { echo "---- last lines of $1 ----" >&2; tail -n "${2:-15}" "$1" >&2 || true; }

check_tp_size() {  # before any rank starts: refuse a tp_size or split that the H3 models here cannot be split into
  local models="${BASE_DIR:-$COMFYUI}/models" files=() encoders=() explicit=0 f rc=0
  while IFS= read -r -d '' f; do encoders+=("$f"); done < <(find -L "$models/text_encoders" "$models/clip" -type f \
    -name '*.safetensors' -print0 2>/dev/null || true)
  if [[ -n "$CKPT" ]]; then
    explicit=1
    for f in "$CKPT" "$models/diffusion_models/$CKPT" "$models/unet/$CKPT"; do [[ -f "$f" ]] && { files=("$f"); break; }; done
    [[ ${#files[@]} -eq 1 ]] || die "--ckpt $CKPT: no such file, nor in $models/diffusion_models or $models/unet"
  else  # every file ComfyUI would list for a diffusion model loader
    while IFS= read -r -d '' f; do files+=("$f"); done < <(find -L "$models/diffusion_models" "$models/unet" -type f \
      -name '*.safetensors' -print0 2>/dev/null || true)
    if [[ ${#files[@]} -eq 0 && ${#encoders[@]} -eq 0 ]]; then
      echo "tp_size $TP_SIZE: no checkpoint in $models/diffusion_models to check it against (--ckpt NAME checks one elsewhere)"
      return 0
    fi
  fi
  PYTHONPATH="$PACK_DIR${PYTHONPATH:+:$PYTHONPATH}" "$PY" "$PACK_DIR/scripts/lib/check_tp_size.py" "$TP_SIZE" "$SPLIT" "$explicit" \
    ${files[@]+"${files[@]}"} ${encoders[@]+"${encoders[@]}"} || rc=$?
  case $rc in
    0) ;;
    2) die "tp_size $TP_SIZE${SPLIT:+, split $SPLIT,} refused before starting any rank: the model named above cannot be split that way; use a tp_size or split named above" ;;
    3) die "the check of tp_size $TP_SIZE${SPLIT:+, split $SPLIT,} against the file named above did not finish: not starting (move that file away, or name a checkpoint with --ckpt)" ;;
    *) echo "start-tp2: WARNING: could not check tp_size $TP_SIZE against the checkpoints ($PY failed, above); starting anyway" >&2 ;;
  esac
}

running_elsewhere() {  # the run folders of other sets of ranks running on this machine, from the ranks' command lines
  ps -ww -eo args= 2>/dev/null | sed -n 's|.* --output-directory \(.*\)/rank[0-9][0-9]*/output .*|\1|p' | sort -u | grep -vxF "$RUN_DIR" || true
}

no_run_here() {  # what: say there is no run in $RUN_DIR and where sets are running; exit 1 if any is
  local others; others="$(running_elsewhere)"
  if [[ -n "$others" ]]; then
    echo "start-tp2: $1 in $RUN_DIR; ranks are running from:" >&2
    while IFS= read -r d; do echo "  $d   ($(pack_cmd start-tp2.sh) $cmd --run-dir $d)" >&2; done <<< "$others"
    exit 1
  fi
}

stop_ranks() {
  if [[ ! -f "$PIDS" ]]; then
    no_run_here "nothing to stop ($([[ -d "$RUN_DIR" ]] && echo "no pids file" || echo "no such folder"))"
    echo "start-tp2: nothing to stop in $RUN_DIR ($([[ -d "$RUN_DIR" ]] && echo "no pids file" || echo "no such folder")), and no ranks run elsewhere"
    return 0
  fi
  : > "$RUN_DIR/stopping"  # the supervisors see it and do not start what is being stopped
  for f in "$RUN_DIR"/rank*.supervisor; do
    [[ -f "$f" ]] || continue
    spid="$(cat "$f")"; alive "$spid" && kill -TERM "$spid" 2>/dev/null || true; rm -f "$f"
  done
  while read -r rank pid port; do
    if alive "$pid"; then kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true; fi
  done < "$PIDS"
  for _ in $(seq 1 60); do
    local left=0
    while read -r rank pid port; do alive "$pid" && left=1; done < "$PIDS"
    [[ $left -eq 0 ]] && break
    sleep 0.25
  done
  while read -r rank pid port; do
    if alive "$pid"; then kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true; echo "rank $rank (pid $pid) killed"; fi
  done < "$PIDS"
  for _ in $(seq 1 60); do  # returned only once a new start could bind the same ports
    local busy=0
    while read -r rank pid port; do port_free "$port" "$LISTEN" || busy=1; done < "$PIDS"
    [[ $busy -eq 0 ]] && break
    sleep 0.25
  done
  echo "stopped the ranks of $RUN_DIR"
  rm -f "$PIDS" "$RUN_DIR/stopping"
}

set_pid() {  # rank pid port: this rank's line of the pids file, under a lock (supervisors write it concurrently)
  ( flock 9
    { grep -v "^$1 " "$PIDS" 2>/dev/null || true; echo "$1 $2 $3"; } | sort -n > "$PIDS.tmp" && mv "$PIDS.tmp" "$PIDS"
  ) 9> "$PIDS.lock"
}

restarts_of() {  # rank: "N restart(s); last: <when and why>, its log's last line", or nothing
  local f="$RUN_DIR/rank$1.restarts" last
  [[ -s "$f" ]] || return 0
  last="$(awk '/^    / { tail = $0; next } { entry = $0; tail = "" } END { sub(/^ +/, "", tail); print entry (tail ? "; its log ended: " tail : "") }' "$f")"
  echo "$(grep -c ' exited \| by hand' "$f") restart(s); last: $last"
}

split_of() {  # port: the split the ranks run, as rank 0 reports it (the one each model was cut by)
  "$PY" - "$1" <<'EOF' 2>/dev/null
import json, sys, urllib.request
print(json.load(urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/tp2/status", timeout=3))["split"])
EOF
}

status_ranks() {
  [[ -d "$RUN_DIR" ]] || { no_run_here "no run folder"; die "no run folder $RUN_DIR (not started here; give the start's --run-dir DIR)"; }
  [[ -f "$PIDS" ]] || { no_run_here "no ranks recorded"; die "no ranks recorded in $RUN_DIR (not started, or stopped)"; }
  local bad=0
  while read -r rank pid port; do
    local sup="" spid=""; [[ -f "$RUN_DIR/rank$rank.supervisor" ]] && spid="$(cat "$RUN_DIR/rank$rank.supervisor")"
    alive "${spid:-0}" && sup=" (restarted if it exits)"
    if ! alive "$pid"; then
      if [[ -n "$sup" ]]; then echo "rank $rank: RESTARTING (pid $pid ended, port $port)"; else echo "rank $rank: DEAD (pid $pid, port $port)"; fi
      tail_log "$RUN_DIR/rank$rank.log"; bad=1
    elif answers "$port"; then
      echo "rank $rank: up, http://$LISTEN:$port (pid $pid)$sup, log $RUN_DIR/rank$rank.log"
    else
      echo "rank $rank: running but not answering on port $port yet (pid $pid)"; bad=1
    fi
    local r; r="$(restarts_of "$rank")"; [[ -n "$r" ]] && echo "        $r"
  done < "$PIDS"
  local split; split="$(split_of "$(awk '$1 == 0 { print $3 }' "$PIDS")")" && echo "split: $split"
  [[ -f "$RUN_DIR/link" ]] && cat "$RUN_DIR/link"
  return $bad
}

oom_kills() { awk '$1 == "oom_kill" { n = $2 } END { print n + 0 }' /proc/vmstat 2>/dev/null || echo 0; }  # the kernel's, since boot

supervise() {  # rank port cmd...: run one rank's ComfyUI, start it again when it exits (bounded)
  local rank=$1 port=$2; shift 2
  local log="$RUN_DIR/rank$rank.log" notes="$RUN_DIR/rank$rank.restarts" tries=0
  local child=""
  trap '' HUP
  trap '[[ -n "$child" ]] && { kill -TERM -- "-$child" 2>/dev/null || kill -TERM "$child" 2>/dev/null; }; exit 0' TERM  # its rank too
  while :; do
    local started ooms; started=$(date +%s) ooms=$(oom_kills)
    ( cd "$COMFYUI"; exec setsid "$@" >> "$log" 2>&1 < /dev/null ) &
    child=$!
    set_pid "$rank" "$child" "$port"
    local rc=0; wait "$child" || rc=$?
    [[ -f "$RUN_DIR/stopping" ]] && exit 0
    if [[ -f "$RUN_DIR/rank$rank.by-hand" ]]; then  # `restart --rank N`: started again at once, not counted as a crash
      rm -f "$RUN_DIR/rank$rank.by-hand"
      echo "==== minimax-h3-tp2: rank $rank restarted by hand ====" >> "$log"
      continue
    fi
    local why="with status $rc"; (( rc > 128 )) && why="killed by signal $((rc - 128)) ($(kill -l $((rc - 128)) 2>/dev/null || echo ?))"
    (( rc == 137 && $(oom_kills) > ooms )) && why="killed by the kernel's out-of-memory killer: the host ran out of RAM ($0 check shows what the ranks need)"
    (( $(date +%s) - started > 300 )) && tries=0  # a crash after a long healthy run is a new problem
    tries=$((tries + 1))
    if (( tries > TP2_MAX_RESTARTS )); then
      echo "$(date '+%F %T') rank $rank gave up after $TP2_MAX_RESTARTS restarts in a row; see $log" >> "$notes"; exit 1
    fi
    { echo "$(date '+%F %T') rank $rank (pid $child) exited $why; restart $tries of $TP2_MAX_RESTARTS"
      tail -n 5 "$log" | sed 's/^/    /'; } >> "$notes"
    echo "==== minimax-h3-tp2: rank $rank exited $why; started again ($tries of $TP2_MAX_RESTARTS) ====" >> "$log"
    sleep 1
  done
}

start_supervisor() {  # rank: start its supervisor (detached; its output goes to the rank's log)
  local r=$1 d="$RUN_DIR/rank$1"
  mkdir -p "$d/output" "$d/temp" "$d/user"
  local args=("$PY" main.py --listen "$LISTEN" --port $((BASE_PORT + r)) --output-directory "$d/output" --temp-directory "$d/temp"
              --user-directory "$d/user" --database-url "sqlite:///$d/comfyui.db" --disable-auto-launch)
  [[ -n "$BASE_DIR" ]] && args+=(--base-directory "$BASE_DIR")
  [[ $CPU -eq 1 ]] && args+=(--cpu)
  args+=("${EXTRA[@]}")
  ( if [[ $CPU -eq 1 ]]; then export CUDA_VISIBLE_DEVICES=""; else export CUDA_VISIBLE_DEVICES="${GPU_LIST[$r]}"; fi
    [[ -n "$SPLIT" ]] && export TP2_SPLIT="$SPLIT"
    export TP2_RANK=$r TP2_WORLD_SIZE=$TP_SIZE MASTER_ADDR=127.0.0.1 MASTER_PORT TP2_SECRET_FILE="$SECRET_FILE" TP2_RANK_URLS="$RANK_URLS"
    supervise "$r" $((BASE_PORT + r)) "${args[@]}" ) > /dev/null 2>&1 < /dev/null &
  echo $! > "$RUN_DIR/rank$r.supervisor"
}

restart_rank() {
  [[ -d "$RUN_DIR" ]] || die "no run folder $RUN_DIR (not started here; give the start's --run-dir DIR)"
  [[ -f "$PIDS" ]] || die "no ranks recorded in $RUN_DIR (not started, or stopped)"
  [[ "$RANK_ARG" =~ ^[0-9]+$ ]] || die "restart needs --rank N"
  local line; line="$(grep "^$RANK_ARG " "$PIDS" || true)"
  [[ -n "$line" ]] || die "no rank $RANK_ARG in $RUN_DIR/pids"
  read -r _ pid port <<< "$line"
  local spid=""; [[ -f "$RUN_DIR/rank$RANK_ARG.supervisor" ]] && spid="$(cat "$RUN_DIR/rank$RANK_ARG.supervisor")"
  if alive "${spid:-0}"; then
    echo "restarting rank $RANK_ARG (pid $pid): its supervisor starts it again"
    echo "$(date '+%F %T') rank $RANK_ARG restarted by hand (start-tp2.sh restart)" >> "$RUN_DIR/rank$RANK_ARG.restarts"
    : > "$RUN_DIR/rank$RANK_ARG.by-hand"  # its supervisor does not count this exit against TP2_MAX_RESTARTS
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  else
    [[ -f "$RUN_DIR/launch.env" ]] || die "no launch settings in $RUN_DIR (started by an older start-tp2.sh): stop and start the ranks"
    alive "$pid" && { kill -TERM -- "-$pid" 2>/dev/null || true; sleep 2; }
    echo "restarting rank $RANK_ARG (its supervisor had stopped)"
    start_supervisor "$RANK_ARG"
  fi
  local deadline=$(( $(date +%s) + TP2_START_TIMEOUT_S ))
  sleep 1
  until answers "$port"; do
    [[ $(date +%s) -gt $deadline ]] && { echo "start-tp2: rank $RANK_ARG did not answer within ${TP2_START_TIMEOUT_S} s" >&2; tail_log "$RUN_DIR/rank$RANK_ARG.log" 30; exit 1; }
    sleep 0.5
  done
  echo "rank $RANK_ARG: up again on port $port; the ranks form a new group at the next prompt"
}

case "$cmd" in
  stop) stop_ranks; exit 0 ;;
  status) status_ranks; exit $? ;;
  restart)
    # shellcheck disable=SC1091
    [[ -f "$RUN_DIR/launch.env" ]] && source "$RUN_DIR/launch.env"
    restart_rank; exit $? ;;
esac

# ---- start ----
# shellcheck source=lib/comfyui_dir.sh
source "$PACK_DIR/scripts/lib/comfyui_dir.sh"
resolve_comfyui "$COMFYUI_ARG"
echo "ComfyUI: $COMFYUI ($COMFYUI_FROM)"
[[ -f "$COMFYUI/main.py" ]] || die "no ComfyUI at '$COMFYUI' ($COMFYUI_FROM): give --comfyui DIR, or run $(pack_cmd install.sh) --comfyui DIR (it clones ComfyUI into DIR when there is none)"
COMFYUI="$(cd "$COMFYUI" && pwd)"
resolve_python "$PYTHON_ARG"
echo "Python: $PY ($PY_FROM)"
[[ "$cmd" == check ]] && exec env PYTHONPATH="$PACK_DIR${PYTHONPATH:+:$PYTHONPATH}" "$PY" "$PACK_DIR/scripts/lib/check.py" \
  --tp-size "$TP_SIZE" --gpus "$GPUS" --split "$SPLIT" $([[ $CPU -eq 1 ]] && echo --cpu)  # per GPU, link, capacity, speed-up
ALLOCATOR="ComfyUI's (cudaMallocAsync where it chooses it)"
if [[ $LEAN_MEMORY -eq 1 ]]; then
  [[ "${PYTORCH_CUDA_ALLOC_CONF:-}" == *cudaMallocAsync* ]] \
    && die "$([[ $PIN_WEIGHTS -eq 1 ]] && echo --pin-weights || echo --lean-memory) uses torch's native allocator, but PYTORCH_CUDA_ALLOC_CONF=$PYTORCH_CUDA_ALLOC_CONF asks for cudaMallocAsync: unset one of them"
  EXTRA+=(--disable-cuda-malloc)
  ALLOCATOR="torch's native${PYTORCH_CUDA_ALLOC_CONF:+, PYTORCH_CUDA_ALLOC_CONF=$PYTORCH_CUDA_ALLOC_CONF}"
  [[ $PIN_WEIGHTS -eq 1 ]] && ALLOCATOR+=" (--pin-weights: with pinned copies cudaMallocAsync's pool ran out at 1920x1088 on 22 GiB)"
fi
echo "minimax-h3-tp2 settings: TP2_INT8_KERNEL=$TP2_INT8_KERNEL TP2_ATTN_BACKEND=$TP2_ATTN_BACKEND TP2_REDUCE_DTYPE=$TP2_REDUCE_DTYPE TP2_SEQUENCE_PARALLEL=$TP2_SEQUENCE_PARALLEL TP2_SP_INT8_GATHER=$TP2_SP_INT8_GATHER TP2_SP_FUSED_NORM=$TP2_SP_FUSED_NORM TP2_PARALLEL_VAE=$TP2_PARALLEL_VAE TP2_TIMEOUT_S=$TP2_TIMEOUT_S TP2_PROMPT_TIMEOUT_S=$TP2_PROMPT_TIMEOUT_S"
echo "minimax-h3-tp2 CUDA allocator: $ALLOCATOR"
[[ $PIN_WEIGHTS -eq 0 && " ${EXTRA[*]} " != *" --disable-pinned-memory "* ]] && EXTRA+=(--disable-pinned-memory)
if [[ " ${EXTRA[*]} " == *" --disable-pinned-memory "* ]]; then
  echo "minimax-h3-tp2 pinned weight copies: off (ComfyUI's --disable-pinned-memory; --pin-weights keeps them)"
else
  echo "minimax-h3-tp2 pinned weight copies: on (--pin-weights: each rank holds a page-locked copy of its weights)"
fi
[[ "$TP_SIZE" =~ ^[1-9][0-9]*$ ]] || die "--tp-size must be a positive integer, got '$TP_SIZE'"
if [[ -n "$SPLIT" && "$SPLIT" != auto ]]; then  # a typo is told at once: tp2.split imports no torch
  why="$(PYTHONPATH="$PACK_DIR" "$PY" -c 'import sys; from tp2.errors import TP2Error; from tp2.split import parse_split
try: parse_split(sys.argv[1], int(sys.argv[2]))
except TP2Error as e: sys.exit(str(e))' "$SPLIT" "$TP_SIZE" 2>&1)" || die "$why"
fi
if [[ -f "$PIDS" ]]; then
  while read -r rank pid port; do alive "$pid" && die "ranks of $RUN_DIR are already running (rank $rank pid $pid); run: $(pack_cmd start-tp2.sh) stop --run-dir $RUN_DIR"; done < "$PIDS"
  rm -f "$PIDS"
fi
for a in "${EXTRA[@]}"; do  # the launcher owns these: after -- they would bypass the checks below, or clash
  opt="${a%%=*}"  # ComfyUI's argparse also takes '--opt=value' and any unambiguous abbreviation ('--liste')
  if [[ ${#opt} -ge 3 && "--listen" == "$opt"* ]]; then
    die "'$a' after -- is ComfyUI's --listen, which the launcher owns: use start-tp2.sh --listen ADDR (with --allow-remote beyond loopback)"
  elif [[ ${#opt} -ge 3 && "--port" == "$opt"* ]]; then
    die "'$a' after -- is ComfyUI's --port, which the launcher owns: use start-tp2.sh --base-port N (rank r gets N + r)"
  fi
done
if [[ "$LISTEN" != 127.0.0.1 && "$LISTEN" != localhost ]]; then
  [[ $ALLOW_REMOTE -eq 1 ]] || die "--listen $LISTEN exposes ComfyUI's API (no authentication) beyond this machine; add --allow-remote if you mean it"
  echo "WARNING: listening on $LISTEN: anyone who can reach these ports can queue prompts and read outputs (ComfyUI's API has no authentication)" >&2
fi
nodes_dir="${BASE_DIR:-$COMFYUI}/custom_nodes"
[[ -d "$nodes_dir" ]] || die "no custom_nodes folder at $nodes_dir"
found=0
for d in "$nodes_dir"/*; do [[ "$(readlink -f "$d")" == "$PACK_DIR" ]] && found=1; done
[[ $found -eq 1 ]] || die "the pack is not in $nodes_dir; run: $(pack_cmd install.sh) --comfyui $COMFYUI (or link $PACK_DIR there)"
[[ "$SPLIT" == auto ]] || check_tp_size  # auto: once the shares are measured, below

if [[ $CPU -eq 1 ]]; then
  IFS=, read -r -a GPU_LIST <<< "$(seq -s, 0 $((TP_SIZE - 1)))"
else
  if [[ -z "$GPUS" ]]; then
    command -v nvidia-smi >/dev/null 2>&1 \
      || die "tp_size $TP_SIZE needs $TP_SIZE GPUs, and there is no nvidia-smi here (no NVIDIA driver?): use --gpus LIST, or --cpu for a CPU test run"
    n="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)"
    [[ $n -ge $TP_SIZE ]] || die "tp_size $TP_SIZE needs $TP_SIZE GPUs, nvidia-smi shows $n (use --gpus LIST, or --cpu for a CPU test run)"
    GPUS="$(seq -s, 0 $((TP_SIZE - 1)))"
  fi
  IFS=, read -r -a GPU_LIST <<< "$GPUS"
  [[ ${#GPU_LIST[@]} -eq $TP_SIZE ]] || die "--gpus lists ${#GPU_LIST[@]} GPUs for --tp-size $TP_SIZE"
fi
if [[ $CPU -eq 0 && "${TP2_COMPUTE_DTYPE:-auto}" == auto ]] \
  && nvidia-smi --query-gpu=compute_cap --format=csv,noheader -i "$GPUS" 2>/dev/null | awk '$1 < 8 { low = 1 } END { exit !low }'; then
  export TP2_COMPUTE_DTYPE=fp32  # ranks compute in one dtype: a GPU below compute capability 8.0 has no bf16 tensor cores
  echo "compute dtype: fp32 on every rank (one of GPUs $GPUS is below compute capability 8.0: no bf16 tensor cores)"
fi
rm -f "$RUN_DIR/link"
if [[ $CPU -eq 0 && $TP_SIZE -gt 1 ]]; then  # the wire and NCCL's settings for the link between the GPUs (scripts/lib/link_settings.py); yours win
  mapfile -t LINK < <(PYTHONPATH="$PACK_DIR" "$PY" "$PACK_DIR/scripts/lib/link_settings.py" "$GPUS" 2>/dev/null)
  LINK_SET=""
  for kv in "${LINK[@]:1}"; do
    name="${kv%%=*}"
    if [[ -n "${!name+x}" ]]; then LINK_SET+=" $name=${!name} (yours)"; else export "${kv?}"; LINK_SET+=" $kv"; fi
  done
  echo "link: ${LINK[0]:-unknown (nvidia-smi topo gave none)}; set for it:${LINK_SET:- nothing}${LINK_SET:+ (the wire by the link's kind, NCCL's published; \`check\` predicts each wire)}" \
    | tee "$RUN_DIR/link"
fi
if [[ "$SPLIT" == auto ]]; then  # measured before any rank starts (each GPU alone); the decision is kept with the run
  SPLIT="$(PYTHONPATH="$PACK_DIR${PYTHONPATH:+:$PYTHONPATH}" "$PY" "$PACK_DIR/scripts/lib/balance.py" "$CPU" "${GPU_LIST[@]}" 2>"$RUN_DIR/split")" \
    || { cat "$RUN_DIR/split" >&2; die "--split auto could not measure the GPUs (above); give the shares yourself, e.g. --split 3:2"; }
  cat "$RUN_DIR/split"
  echo "--split auto chose $SPLIT" | tee -a "$RUN_DIR/split"
  check_tp_size
fi
for (( r = 0; r < TP_SIZE; r++ )); do  # a taken port would otherwise surface only after every rank's start-up
  port_free $((BASE_PORT + r)) "$LISTEN" \
    || die "port $((BASE_PORT + r)) (rank $r) is in use on $LISTEN: stop what holds it, or start with --base-port N (rank r gets N + r)"
done
if [[ -n "${MASTER_PORT:-}" ]]; then  # the user's choice (e.g. a port their firewall allows); refused if it is taken
  [[ "$MASTER_PORT" =~ ^[0-9]+$ && $MASTER_PORT -ge 1 && $MASTER_PORT -le 65535 ]] || die "MASTER_PORT=$MASTER_PORT is not a port number"
  port_free "$MASTER_PORT" || die "MASTER_PORT=$MASTER_PORT is in use on 127.0.0.1: unset it (a free port is picked) or choose another"
else
  MASTER_PORT="$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
fi
# the per-run secret that authenticates rank 0's forwards (and tp2-submit) to the followers
SECRET_FILE="$RUN_DIR/secret"
rm -f "$SECRET_FILE"  # made fresh, readable by this user only, whatever mode an old one had
( umask 077; "$PY" -c 'import secrets; print(secrets.token_hex(32))' > "$SECRET_FILE" )
chmod 600 "$SECRET_FILE"
HOST="$LISTEN"; [[ "$HOST" == 0.0.0.0 ]] && HOST=127.0.0.1
RANK_URLS="$(for (( r = 0; r < TP_SIZE; r++ )); do printf 'http://%s:%d,' "$HOST" $((BASE_PORT + r)); done)"
RANK_URLS="${RANK_URLS%,}"

interrupted() {  # Ctrl-C (or TERM) while the ranks start: stop what this start began, and say what that was
  trap '' INT TERM
  local what pids left="" p
  what="$(awk '{ printf "%srank %s (pid %s, port %s)", (NR > 1 ? ", " : ""), $1, $2, $3 }' "$PIDS" 2>/dev/null)"
  pids="$(awk '{ print $2 }' "$PIDS" 2>/dev/null) $(cat "$RUN_DIR"/rank*.supervisor 2>/dev/null)"
  echo "start-tp2: interrupted while the ranks started: stopping ${what:-their supervisors (no rank process yet)}" >&2
  stop_ranks >&2
  for p in $pids; do alive "$p" && left+=" $p"; done
  [[ -z "$left" ]] || echo "start-tp2: could not stop pid(s)$left: end them with kill -KILL$left" >&2
  exit 130
}

check_python
echo "minimax-h3-tp2: starting $TP_SIZE ranks of $COMFYUI under $PY (MASTER_PORT=$MASTER_PORT)"
trap interrupted INT TERM
: > "$PIDS"; rm -f "$RUN_DIR"/rank*.restarts "$RUN_DIR/stopping" "$RUN_DIR/rank0.queue.json"  # a fresh start: an empty queue
for (( r = 0; r < TP_SIZE; r++ )); do : > "$RUN_DIR/rank$r.log"; done
# what `restart` needs to start a rank again the same way
{ declare -p COMFYUI PY LISTEN BASE_PORT BASE_DIR CPU GPU_LIST EXTRA TP_SIZE SPLIT MASTER_PORT SECRET_FILE RANK_URLS
  for v in "${!TP2_@}" "${!NCCL_@}"; do declare -p "$v"; done; } > "$RUN_DIR/launch.env"
for (( r = TP_SIZE - 1; r >= 0; r-- )); do
  start_supervisor "$r"
done
for _ in $(seq 1 100); do [[ $(wc -l < "$PIDS") -ge $TP_SIZE ]] && break; sleep 0.1; done

deadline=$(( SECONDS + TP2_START_TIMEOUT_S ))  # SECONDS: no fork, which a Ctrl-C would end mid-test
while read -r rank pid port; do
  until answers "$port"; do
    if ! alive "$pid"; then
      echo "start-tp2: rank $rank (GPU ${GPU_LIST[$rank]}, port $port) exited during start-up" >&2
      tail_log "$RUN_DIR/rank$rank.log" 30; stop_ranks >/dev/null; exit 1
    fi
    if (( SECONDS > deadline )); then
      echo "start-tp2: rank $rank (port $port) did not answer within ${TP2_START_TIMEOUT_S} s" >&2
      tail_log "$RUN_DIR/rank$rank.log" 30; stop_ranks >/dev/null; exit 1
    fi
    sleep 0.5
  done
done < "$PIDS"
trap - INT TERM
sort -n "$PIDS" -o "$PIDS"
while read -r rank pid port; do
  echo "  rank $rank: http://$LISTEN:$port  $([[ $CPU -eq 1 ]] && echo cpu || echo "GPU ${GPU_LIST[$rank]}")  log $RUN_DIR/rank$rank.log"
done < "$PIDS"
echo "ready. open rank 0 in a browser and queue as usual (it runs on every rank), or submit an API-format workflow"
echo "(e.g. $( [[ "$PWD" == "$PACK_DIR" ]] || echo "$PACK_DIR/")workflows/api/h3_tp2_t2v_832x480.json) and verify that every rank made the same bytes:"
echo "       $(pack_cmd tp2-submit) WORKFLOW.json --run-dir $RUN_DIR"
echo "status:         $(pack_cmd start-tp2.sh) status --run-dir $RUN_DIR"
echo "stop:           $(pack_cmd start-tp2.sh) stop --run-dir $RUN_DIR"
