#!/usr/bin/env bash
# The host-memory measurement of a 2 x 22 GiB pair on one GPU, in at most three device calls of 600 s, the same command
# each time (from the pack's folder, .device carried):   bash scripts/bench.sh --host-memory
# The first call starts the whole run in the background (its own session, so it outlives the call while the machine is
# held) and follows it; a later call on the still-warm machine follows the same run. Each call returns after
# TP2_BENCH_FOLLOW_S seconds (default 540) or when the run ends, with what is done so far in $OUT:
#   host_memory.log (the run's log), whole_video.jsonl (a row per config and prompt), its table, server_logs.tar.xz
# The run: the four models at full size, each H3 file cut for 2 ranks into the rank cache as it is written and then freed
# on disk (make_models.py --cut-ahead 2: the models and both caches fit the 64 GiB disk); then the bundled T2V+audio
# workflow, 2 steps, cold then warm, both ranks on GPU 0 each confined to 22 GiB by CUDA MPS (whole_video.py tp2@22
# --one-gpu), at 832x480x124 and 1920x1088x124, the host unlimited and with 63 GiB held (a 64 GB machine), with and
# without ComfyUI's --disable-pinned-memory, the rows not yet measured first; then one TP2 rank's block over emulated
# links (link_emulator.py). Called by bench.sh: W, PY, PACK_DIR and PYTHONPATH set.
set -uo pipefail
HM="$W/host_memory"; R="$HM/results"; PIDFILE="$HM/run.pid"
export TP2_CACHE_DIR="$W/cache"

run() {
  local base="$W/base" wv=("$PY" "$PACK_DIR/scripts/bench/whole_video.py" --comfyui "$W/ComfyUI" --base "$W/base" --front-end "$W/fe"
    --out "$R" --one-gpu --prompts cold,warm --steps 2)   # a later --steps wins (1 at 1920x1088: its gloo sampling is slow)
  local t0; t0=$(date +%s)
  "$PY" "$PACK_DIR/scripts/bench/make_models.py" --comfyui "$W/ComfyUI" --models "$base/models" --cut-ahead 2 || { echo "set-up failed"; return 1; }
  df -h "$W" | tail -1; echo "set-up took $(( $(date +%s) - t0 )) s"
  step() { echo "== $(date +%T) whole_video $*"; "${wv[@]}" "$@" || echo "== (a prompt failed: see its row)"; }
  # measured on 2026-12-06 (docs/PERFORMANCE.md): 832x480 pinned unlimited and unpinned on 64 GB, 1920x1088 pinned unlimited
  # (out of GPU memory) and the unpinned cold prompt on 64 GB; the rest, the launcher's default (no pinned copies) first
  step --configs tp2@22+disable-pinned-memory --size 1920x1088 --steps 1
  step --configs tp2@22+disable-pinned-memory --size 1920x1088 --steps 1 --host-hold-gib 63
  step --configs tp2@22+disable-pinned-memory
  step --configs tp2@22 --host-hold-gib 63
  step --configs tp2@22 --size 1920x1088 --steps 1 --host-hold-gib 63
  PYTHONPATH="$PACK_DIR:$PYTHONPATH" timeout 600 "$PY" "$PACK_DIR/scripts/bench/link_emulator.py" \
    --link 10:15,20:15,25:15,50:15,216:10 --wire fp32,bf16   # issue 56's link emulator: one rank's block, ms
  echo "== $(date +%T) run ended after $(( $(date +%s) - t0 )) s"
}

follow() {
  local end=$(( $(date +%s) + ${TP2_BENCH_FOLLOW_S:-540} )) at=0 pid; pid=$(cat "$PIDFILE")
  while :; do
    local size; size=$(stat -c %s "$HM/log" 2>/dev/null || echo 0)
    (( size > at )) && { tail -c +$(( at + 1 )) "$HM/log" | head -c $(( size - at )); at=$size; }
    kill -0 "$pid" 2>/dev/null || { echo "== the run has ended"; break; }
    (( $(date +%s) >= end )) && { echo "== still running (pid $pid): call again at once to follow it"; break; }
    sleep 5
  done
  local dest="${OUT:-$PWD/bench-out}"; mkdir -p "$dest"
  cp "$HM/log" "$dest/host_memory.log"
  cp "$R/whole_video.jsonl" "$dest/" 2>/dev/null
  [[ -d "$R/run" ]] && (cd "$R" && find run -name comfyui.log -print0 | tar --null -cJf "$dest/server_logs.tar.xz" -T -)
  [[ ! -f "$R/whole_video.jsonl" ]] || "$PY" -c "import json, sys; sys.path.insert(0, sys.argv[1]); from whole_video import table
print(table([json.loads(line) for line in open(sys.argv[2])]))" "$PACK_DIR/scripts/bench" "$R/whole_video.jsonl" | tee "$dest/whole_video_table.md"
}

case "${1:-}" in
  run) run ;;
  follow) follow ;;
  start)
    mkdir -p "$R"
    setsid bash "${BASH_SOURCE[0]}" run > "$HM/log" 2>&1 < /dev/null &
    echo $! > "$PIDFILE"
    echo "host-memory run started (pid $!): the set-up writes ~41 GB of models first"
    follow ;;
  *) echo "host_memory.sh run|follow|start (called by bench.sh --host-memory)" >&2; exit 2 ;;
esac
