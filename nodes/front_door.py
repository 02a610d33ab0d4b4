"""Rank 0 is the front door and holds the only queue: a prompt reaches the followers when rank 0 starts it.

On by TP2_SECRET_FILE (the launcher writes a per-run secret there); without it every rank keeps its own queue
(submit the same prompt id to every rank).

    rank 0     POST /prompt queues here only (a prompt id seen before is refused). As the prompt worker starts it,
               `dispatch` sends it to every follower with rank 0's sequence number, a run id unique to this execution
               and whether every rank clears its node cache first. A follower that cannot take it fails the prompt,
               naming the rank, unless its launcher is starting it again: then the prompt waits up to REJOIN_WAIT_S.
               Cancel, delete and clear act on rank 0's queue alone (followers hold nothing pending). POST /free and
               /history are repeated on every follower; free_memory clears every rank's node cache before the next prompt.
    followers  every state-changing route refuses without the secret; prompts only from rank 0's dispatcher, in its order
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import time

import comfy.model_management as mm
from aiohttp import ClientError, ClientSession, ClientTimeout, web
from execution import SENSITIVE_EXTRA_DATA_KEYS
from server import PromptServer

from ..tp2 import settings
from .queue_journal import install_queue_journal
from .state import STATE, log

HEADER = "X-TP2-Secret"
FOLLOWER_GUARDED = ("/prompt", "/queue", "/interrupt", "/free", "/history")  # POST routes, as _route names them
REPEATED = ("/free", "/history")  # rank 0 repeats these on every follower
FORWARD_TIMEOUT = ClientTimeout(total=60, sock_connect=3)
PROBE_TIMEOUT = ClientTimeout(total=5, sock_connect=2)
REJOIN_WAIT_S = 120.0  # how long rank 0 holds a prompt for a follower its launcher is starting again


def _route(request: web.Request) -> str:
    """The route without /api prefixes: ComfyUI serves every route under /api too (/api/api/jobs/cancel is jobs cancel)."""
    path = request.path
    while path.startswith("/api/"):
        path = path[len("/api") :]
    return path


class FrontDoor:
    def __init__(self, secret: str, rank_urls: list[str]):
        self.secret, self.rank_urls = secret, rank_urls
        self.followers = [(r, u) for r, u in enumerate(rank_urls) if r != 0]
        self.run_dir = os.path.dirname(settings.value("TP2_SECRET_FILE"))  # the launcher's: the secret file's folder
        self.seq = 0  # rank 0: prompts dispatched by this process
        self.orders: dict[str, dict] = {}  # follower: prompt id -> rank 0's order for it (run, seq, boot, reset)
        self.last_order: tuple[str, int] | None = None  # follower: (rank 0 boot id, seq) of the last order taken

    async def forward(self, path: str, body: dict) -> list[str]:
        """POST `body` to `path` on every follower; the problems, one line per rank that did not take it."""

        async def one(rank: int, url: str, again: bool = True) -> str | None:
            try:
                async with ClientSession(timeout=FORWARD_TIMEOUT) as s, s.post(url + path, json=body, headers={HEADER: self.secret}) as r:
                    status, text = r.status, await r.text()
            except asyncio.TimeoutError:
                return (f"rank {rank} ({url}) did not answer within {FORWARD_TIMEOUT.total:.0f} s: it is frozen or overloaded "
                        f"(scripts/start-tp2.sh status; restart it with scripts/start-tp2.sh restart --rank {rank})")  # fmt: skip
            except (ClientError, OSError) as e:
                return f"rank {rank} ({url}) is not reachable ({type(e).__name__}: {e}); start it again (scripts/start-tp2.sh status)"
            if again and status == 409 and "tp2_out_of_order" in text:  # it moved its mark back: hand it over again, once
                log.warning("%s rank %d held an order later than any rank 0 sent (not rank 0's): handed over again", STATE.tag, rank)
                return await one(rank, url, again=False)
            return None if status == 200 else f"rank {rank} ({url}) refused it ({status}): {_error_text(text)}"

        return [p for p in await asyncio.gather(*(one(r, u) for r, u in self.followers)) if p]

    async def dispatch(self, prompt: dict, prompt_id: str, extra_data: dict, outputs: list, reset: bool) -> tuple[str, bool, str | None]:
        """Send the prompt rank 0 is starting to every follower: (the run id, whether every rank clears its node cache
        first, why a follower could not take it)."""
        reset = await self._wait_for_restarts(prompt_id) or reset  # a restarted rank's cache is empty: every rank clears
        boot = STATE.session.watcher.boot_id
        if mm.processing_interrupted():  # interrupted while it waited: it reaches no follower
            return f"{prompt_id}.{boot[:8]}.interrupted", reset, None
        self.seq += 1
        run = f"{prompt_id}.{boot[:8]}.{self.seq}"
        order = {"run": run, "seq": self.seq, "boot": boot, "reset": reset}
        extra = {k: v for k, v in extra_data.items() if k not in SENSITIVE_EXTRA_DATA_KEYS}  # API keys stay on rank 0
        body = {"prompt": prompt, "prompt_id": prompt_id, "extra_data": extra, "number": self.seq, "tp2": order,
                "partial_execution_targets": list(outputs)}  # fmt: skip
        problems = await self.forward("/prompt", body)
        return run, reset, "; ".join(problems) or None

    async def _wait_for_restarts(self, prompt_id: str) -> bool:
        """Wait (at most REJOIN_WAIT_S, until an interrupt) while a follower its launcher is starting again is down; whether one was."""
        down = [r for r, answers in zip((r for r, _ in self.followers), await self._answering()) if not answers and self.restarting(r)]
        if not down:
            return False
        log.warning("%s rank(s) %s not reachable while the launcher starts them again: prompt %s waits up to %.0f s",
                    STATE.tag, ", ".join(map(str, down)), prompt_id, REJOIN_WAIT_S)  # fmt: skip
        deadline = time.monotonic() + REJOIN_WAIT_S
        while time.monotonic() < deadline and not mm.processing_interrupted():
            await asyncio.sleep(1.0)
            if all(await self._answering()):
                log.info("%s every rank is back: prompt %s is handed over", STATE.tag, prompt_id)
                break
        return True

    async def _answering(self) -> list[bool]:
        """Whether each follower's HTTP API answers (GET /tp2/status)."""
        async with ClientSession(timeout=PROBE_TIMEOUT) as s:
            return [status is not None for status, _ in await asyncio.gather(*(fetch_status(s, u) for _, u in self.followers))]

    def restarting(self, rank: int) -> bool:
        """Whether the launcher's supervisor of `rank` is alive to start it again (RUN_DIR/rank<r>.supervisor)."""
        if os.path.exists(os.path.join(self.run_dir, "stopping")):
            return False
        try:
            with open(os.path.join(self.run_dir, f"rank{rank}.supervisor")) as f:
                pid = int(f.read().strip())
            with open(f"/proc/{pid}/stat") as f:  # none when it is gone; a zombie when it ended unreaped (no init to reap it)
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, ValueError, IndexError):
            return False

    async def _rank0(self, request: web.Request, handler, route: str):
        body = await _json(request)
        if route == "/prompt":
            prompt_id = body.get("prompt_id")
            if prompt_id is not None and _known_prompt_id(prompt_id):
                why = f"prompt id {prompt_id} was queued or run before on this server: a prompt id is used once. Omit it to get a new one."
                return _refusal("tp2_prompt_id_reused", why, 409)
            return await handler(request)
        if route == "/free":
            if body.get("free_memory"):  # every rank clears its node cache before the next prompt, in step
                STATE.session.cache_epoch(bump=True)
            body = {"unload_models": bool(body.get("unload_models"))}
        for p in await self.forward(route, body):
            log.warning("%s could not repeat %s on a follower: %s", STATE.tag, route, p)
        return await handler(request)

    async def _follower(self, request: web.Request, handler, route: str):
        if not hmac.compare_digest(request.headers.get(HEADER, ""), self.secret):
            why = (f"This ComfyUI is tensor-parallel rank {STATE.env.tp_rank} of {STATE.env.tp_size}, a follower: use rank 0 "
                   f"({self.rank_urls[0]}); it queues prompts and runs them on every rank.")  # fmt: skip
            return _refusal("tp2_follower", why, 403)
        if route != "/prompt":
            return await handler(request)
        # a restarted follower takes prompts only once its peers can see it restarted (its boot id is published)
        await asyncio.get_running_loop().run_in_executor(None, STATE.boot_registered.wait, 15.0)
        body = await _json(request)
        order, prompt_id = body.get("tp2"), body.get("prompt_id")
        if not _well_formed(order) or not prompt_id:
            return _refusal("tp2_follower", "followers take prompts only from rank 0's dispatcher (scripts/tp2-submit uses rank 0)", 403)
        if self.last_order is not None and self.last_order[0] == order["boot"] and order["seq"] <= self.last_order[1]:
            why = f"order {order['seq']} arrived after order {self.last_order[1]} from the same rank 0: refused to keep the ranks in step"
            # the mark moves back to just before rank 0's count, which hands the order over again: an order with a count
            # rank 0 never reached (not rank 0's) blocks nothing
            self.last_order = (order["boot"], order["seq"] - 1)
            return _refusal("tp2_out_of_order", why, 409)
        self.orders[prompt_id] = order
        response = await handler(request)
        if response.status == 200:
            self.last_order = (order["boot"], order["seq"])
        else:
            self.orders.pop(prompt_id, None)
        return response

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        route = _route(request) if request.method == "POST" else ""
        if STATE.env.tp_rank == 0 and route in ("/prompt", *REPEATED):
            return await self._rank0(request, handler, route)
        if STATE.env.tp_rank != 0 and (route in FOLLOWER_GUARDED or (route.startswith("/jobs/") and route.endswith("/cancel"))):
            return await self._follower(request, handler, route)
        return await handler(request)

    async def ranks(self, request: web.Request):
        ranks = [{"rank": r, "url": u} for r, u in enumerate(self.rank_urls)]
        return web.json_response({"tp_size": STATE.env.tp_size, "this_rank": STATE.env.tp_rank, "ranks": ranks})


def _known_prompt_id(prompt_id) -> bool:
    queue = PromptServer.instance.prompt_queue
    running, pending = queue.get_current_queue_volatile()
    return prompt_id in queue.history or any(item[1] == prompt_id for item in [*running, *pending])


def _well_formed(order) -> bool:
    kinds = {"run": str, "seq": int, "boot": str, "reset": bool}
    return isinstance(order, dict) and all(isinstance(order.get(k), t) for k, t in kinds.items())


def _refusal(kind: str, why: str, status: int) -> web.Response:
    return web.json_response({"error": {"type": kind, "message": why, "details": why, "extra_info": {}}, "node_errors": {}}, status=status)


def _error_text(text: str) -> str:
    try:
        body = json.loads(text)
        err = body.get("error", body)
        msg = err.get("message", "") if isinstance(err, dict) else str(err)
        return (msg + " " + json.dumps(body.get("node_errors") or {}))[:600].strip()
    except (ValueError, AttributeError):
        return text[:300]


async def _json(request: web.Request) -> dict:
    try:
        body = await request.json()
        return body if isinstance(body, dict) else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}


async def fetch_status(session: ClientSession, url: str | None) -> tuple[dict | None, str | None]:
    """A rank's GET /tp2/status over `session`, or why there is none."""
    if not url:
        return None, "unknown address (the front door is off: start the ranks with scripts/start-tp2.sh)"
    try:
        async with session.get(url + "/tp2/status") as r:
            if r.status != 200:
                return None, f"GET /tp2/status answered {r.status}"
            return await r.json(), None
    except asyncio.TimeoutError:
        return None, f"no answer within {session.timeout.total:.0f} s (frozen or overloaded)"
    except (ClientError, OSError, ValueError) as e:
        return None, f"not reachable ({type(e).__name__}: {e})"


FRONT_DOOR: FrontDoor | None = None


def read_secret() -> str | None:
    """The run's secret (TP2_SECRET_FILE), or None when the front door is off."""
    path = settings.value("TP2_SECRET_FILE")
    if not path:
        return None
    with open(path) as f:
        secret = f.read().strip()
    if len(secret) < 16:
        raise ValueError(f"TP2_SECRET_FILE={path} holds {len(secret)} characters, not the launcher's 64: restart with scripts/start-tp2.sh")
    return secret


def install_front_door() -> None:
    """Add the middleware, GET /tp2/ranks and rank 0's queue journal to ComfyUI's server (before it starts), when a secret is set."""
    global FRONT_DOOR
    if STATE.session.watcher.secret is None:
        log.warning("%s TP2_SECRET_FILE is not set: the front door is off (every rank accepts prompts; submit to all ranks)", STATE.tag)
        return
    urls = settings.value("TP2_RANK_URLS")
    if len(urls) != STATE.env.tp_size:
        raise ValueError(f"TP2_RANK_URLS lists {len(urls)} URLs for tp_size {STATE.env.tp_size}; the launcher sets one per rank.")
    FRONT_DOOR = FrontDoor(STATE.session.watcher.secret, urls)
    PromptServer.instance.app.middlewares.append(FRONT_DOOR.middleware)
    PromptServer.instance.routes.get("/tp2/ranks")(FRONT_DOOR.ranks)
    role = f"prompts only from rank 0 ({urls[0]})" if STATE.env.tp_rank else "the only queue; prompts go to the followers as they start"
    log.info("%s front door on: %s", STATE.tag, role)
    if STATE.env.tp_rank == 0:
        install_queue_journal(FRONT_DOOR.run_dir, FRONT_DOOR.secret)
