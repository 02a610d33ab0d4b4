"""Read-only status routes for the web UI's TP panel (web/tp2_panel.js) and anyone else who asks.

    GET /tp2/status    this rank: tp_rank, tp_size, boot, process group and its link, last agreement, the prompt it runs
                       and its progress (ComfyUI's own progress registry), peer heartbeats, the pack's settings
    GET /tp2/cluster   every rank's /tp2/status as this rank reaches them (the front door's rank URLs), each
                       with a health verdict; rank 0's UI polls it

No secret: nothing here changes state (the front door guards only POSTs).
"""

from __future__ import annotations

import asyncio

from aiohttp import ClientSession, ClientTimeout, web
from comfy_execution.progress import get_progress_state

from ..tp2 import settings
from ..tp2.collectives import group_backend, overlap_chunks
from ..tp2.session import is_loopback
from ..tp2.split import even, is_even, named
from . import front_door
from .patches import PATCHES
from .state import STATE

PEER_TIMEOUT = ClientTimeout(total=2.0, sock_connect=1.0)  # a rank that cannot answer a GET in 2 s is reported


def unique_models() -> list[tuple[object, int]]:
    """The H3 models this rank built, each once with its load count (a cache clear reloads the file), latest last."""
    latest: dict[tuple, tuple] = {}
    for m in STATE.models:
        key = (m.source, m.plan_fingerprint, m.checkpoint_fingerprint, m.origin)
        loads = latest.pop(key, (None, 0))[1]  # popped and put back: the most recent load ends the list
        latest[key] = (m, loads + 1)
    return list(latest.values())


def split_named() -> str:
    """The ranks' shares: "even", or as --split takes them with each rank's part ("3:2 (rank 0 60%, rank 1 40%)"), and
    each loaded model whose plan cut another split ("; h3_tiny.safetensors cut even (3:1 asked: too few units)")."""
    shares = STATE.shares or even(STATE.env.tp_size)
    parts = "" if is_even(shares) else f" ({', '.join(f'rank {r} {s / sum(shares):.0%}' for r, s in enumerate(shares))})"
    other = [f"; {m.source} cut {m.split}" for m, _ in unique_models() if m.split != named(shares)]
    return named(shares) + parts + "".join(other)


def status_text() -> str:
    """The status node's text: this rank, its group, its settings (as GET /tp2/status has them), the models it built."""
    if not STATE.active:
        return "TP inactive: TP2_RANK / TP2_WORLD_SIZE are not set, ComfyUI runs as usual."
    env, session = STATE.env, STATE.session
    lines = [
        f"rank {env.tp_rank} of tp_size {env.tp_size}, split {split_named()}",
        f"process group: generation {session.generation}, {'healthy' if session.healthy else 'not formed / needs re-forming'}",
        f"last agreement: {STATE.last_agreement}",
        *(f"{k}: {v}" for k, v in resolved_settings().items()),
    ]
    for m, loads in unique_models():
        loaded = f"{m.origin}, {m.load_seconds:.1f} s" + (f", loaded {loads} times" if loads > 1 else "")
        lines.append(f"model {m.source}: {m.plan_summary}; checkpoint {m.checkpoint_fingerprint}; {loaded}")
        lines.append(f"  changed on the model: {m.changes.summary()}")
    return "\n".join(lines)


def rank_status() -> dict:
    """This rank's state as JSON-ready data (the routes exist only where the pack is active)."""
    env, session = STATE.env, STATE.session
    group, link = session.group, session.link  # the link: measured as the group formed (tp2/link.py)
    link = link and {"bus_gbps": round(link.bus_gbps, 2), "kind": link.kind, "mib": link.mib, "ms": round(link.seconds * 1e3, 2),
                     "prediction": session.link_prediction}  # fmt: skip
    return {
        "active": True,
        "tp_rank": env.tp_rank,
        "tp_size": env.tp_size,
        "split": split_named(),
        "boot": session.watcher.boot_id[:8],
        "registered": STATE.boot_registered.is_set(),
        "group": {
            "generation": session.generation,
            "formed": bool(session.healthy),
            "backend": group.backend if group is not None else None,
            "link": link,
        },
        "stop_reason": session.watcher.stop_reason if session.watcher.run is not None else None,  # a finished run's is history
        "waiting": session.watcher.waiting_text,  # on a peer alive but not progressing (tp2/progress.py)
        "last_agreement": STATE.last_agreement,
        "prompt": {"prompt_id": STATE.prompt.prompt_id, "run": STATE.prompt.run, "model_calls": STATE.prompt.model_calls},
        "progress": prompt_progress(),
        "heartbeats": {str(r): round(age, 1) for r, age in session.watcher.heartbeat_ages().items()},  # seconds since each changed
        "settings": resolved_settings(),
        "models": [{"source": m.source, "plan": m.plan_summary, "loads": n} for m, n in unique_models()],
        "text": status_text(),
    }


def prompt_progress() -> dict | None:
    """The current (or last) prompt's progress from ComfyUI's registry: its sampler-like node (one with steps)."""
    registry = get_progress_state()
    try:
        nodes = list(registry.nodes.items())  # the prompt worker adds entries meanwhile: copy first
    except RuntimeError:
        return None
    if not registry.prompt_id:
        return None
    stepped = [(nid, n) for nid, n in nodes if n["max"] > 1]
    running = [(nid, n) for nid, n in stepped if n["state"].value == "running"]
    node_id, node = (running or stepped or [(None, None)])[-1]
    done = sum(1 for _, n in nodes if n["state"].value == "finished")
    out = {"prompt_id": registry.prompt_id, "nodes_finished": done, "nodes_seen": len(nodes), "node": node_id}
    if node is not None:
        info = registry.dynprompt.get_node(node_id) if registry.dynprompt.has_node(node_id) else {}
        out.update(class_type=info.get("class_type"), value=int(node["value"]), max=int(node["max"]), state=node["state"].value)
    return out


def resolved_settings() -> dict[str, str]:
    """The pack's settings as this rank resolved them at start (the env was read once, by activation)."""
    v = settings.value  # frozen at activation
    n = overlap_chunks(STATE.env.tp_size, group_backend(STATE.device))  # TP2_OVERLAP
    sp = f"on (int8 gathers {v('TP2_SP_INT8_GATHER')}, fused norm {v('TP2_SP_FUSED_NORM')})" if v("TP2_SEQUENCE_PARALLEL") else "off"
    return {
        "device": str(STATE.device),
        "rank store": "on loopback" if is_loopback(STATE.env.master_addr) else "on the network",
        "int8 GEMM": STATE.int8_gemm.kernel_name,
        "attention": STATE.attention,
        "partial sums dtype": str(STATE.reduce_dtype).replace("torch.", ""),
        "wire": v("TP2_WIRE"),
        "row-parallel reduce": f"in {n} chunks, each overlapping the next one's GEMM" if n > 1 else "one collective per layer",
        "sequence parallel": sp,
        "collective timeout": f"{STATE.env.timeout_s:.0f} s",
        "prompt rendezvous timeout": f"{v('TP2_PROMPT_TIMEOUT_S'):.0f} s",
        "front door": "on" if front_door.FRONT_DOOR is not None else "off",
        "numerics check": STATE.numerics,
        "ComfyUI functions patched": ", ".join(PATCHES.names()) or "none",
    }


def health(tp_rank: int, status: dict | None, problem: str | None, ages: dict[str, float]) -> tuple[str, str]:
    """(verdict, why) for one rank: healthy, starting, stopping, waiting, silent, wrong, restarting or unreachable."""
    if status is None:
        door = front_door.FRONT_DOOR
        if door is not None and door.restarting(tp_rank):
            return "restarting", "its process ended; the launcher is starting it again (start-tp2.sh status says why)"
        return "unreachable", problem or "no answer"
    if status["tp_rank"] != tp_rank or status["tp_size"] != STATE.env.tp_size:
        return "wrong", f"it says it is rank {status['tp_rank']} of {status['tp_size']}"
    if not status["registered"]:
        return "starting", "not in the rank store yet"
    if status["stop_reason"]:
        return "stopping", status["stop_reason"]
    if status.get("waiting"):
        return "waiting", status["waiting"]
    age = ages.get(str(tp_rank))
    if age is not None and age > STATE.session.watcher.heartbeat_timeout_s:
        return "silent", f"no heartbeat for {age:.0f} s"
    return "healthy", "answers, registered, heartbeat fresh" if age is not None else "answers, registered"


async def get_status(request: web.Request) -> web.Response:
    return web.json_response(rank_status())


async def get_cluster(request: web.Request) -> web.Response:
    me, mine, door = rank_status(), STATE.env.tp_rank, front_door.FRONT_DOOR
    urls = door.rank_urls if door is not None else [None] * STATE.env.tp_size
    async with ClientSession(timeout=PEER_TIMEOUT) as session:
        fetched = await asyncio.gather(*(front_door.fetch_status(session, u) for r, u in enumerate(urls) if r != mine))
    fetched.insert(mine, (me, None))
    ranks = []
    for r, (url, (status, problem)) in enumerate(zip(urls, fetched)):
        verdict, why = health(r, status, problem, me["heartbeats"])
        ranks.append({"tp_rank": r, "url": url, "health": verdict, "why": why, "status": status})
    healthy = sum(1 for x in ranks if x["health"] == "healthy")
    cluster = {"active": True, "this_rank": mine, "tp_size": STATE.env.tp_size, "split": me["split"], "healthy": healthy}
    return web.json_response({**cluster, "ranks": ranks})


def install_status_routes(routes) -> None:
    """Add the GET routes to ComfyUI's route table (before the server starts; ComfyUI mirrors them under /api)."""
    routes.get("/tp2/status")(get_status)
    routes.get("/tp2/cluster")(get_cluster)
