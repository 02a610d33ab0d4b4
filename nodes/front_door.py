"""Rank 0 is the front door: a prompt queued there (web UI, /prompt, tp2-submit with one port) runs on every rank.

On by TP2_SECRET_FILE (the launcher writes a per-run secret there); without it every rank accepts prompts as
before and nothing is forwarded.

    rank 0     POST /prompt accepted -> the same body and prompt id go to every follower (X-TP2-Secret); a
               follower that cannot take it cancels rank 0's copy at once, with the rank named; POST /queue
               (clear, delete) and /interrupt are repeated on every follower; GET /tp2/ranks lists the ranks
    followers  POST /prompt without the secret is refused (use rank 0); a prompt id seen before is answered
               again without queueing it twice (the dual-submit client and the forward may both deliver it)
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
from collections import OrderedDict

from aiohttp import ClientError, ClientSession, ClientTimeout, web

from .state import STATE

log = logging.getLogger("minimax_h3_tp2")

HEADER = "X-TP2-Secret"
ENV_SECRET_FILE = "TP2_SECRET_FILE"
ENV_RANK_URLS = "TP2_RANK_URLS"
PROMPT_PATHS = ("/prompt", "/api/prompt")
CONTROL_PATHS = ("/interrupt", "/api/interrupt", "/queue", "/api/queue")
FORWARD_TIMEOUT = ClientTimeout(total=20, sock_connect=3)


class FrontDoor:
    def __init__(self, secret: str, rank_urls: list[str]):
        self.secret, self.rank_urls = secret, rank_urls
        self.seen: OrderedDict[str, dict] = OrderedDict()  # follower: prompt id -> the answer it got
        self.failed: dict[str, str] = {}  # rank 0: prompt id -> why a follower could not take it

    def authorised(self, request: web.Request) -> bool:
        return hmac.compare_digest(request.headers.get(HEADER, ""), self.secret)

    @property
    def followers(self) -> list[tuple[int, str]]:
        return [(r, u) for r, u in enumerate(self.rank_urls) if r != 0]

    async def forward(self, path: str, body: dict) -> list[str]:
        """POST `body` to `path` on every follower; the problems, one line per rank that did not take it."""

        async def one(rank: int, url: str) -> str | None:
            try:
                async with ClientSession(timeout=FORWARD_TIMEOUT) as s, s.post(url + path, json=body, headers={HEADER: self.secret}) as r:
                    if r.status == 200:
                        return None
                    return f"rank {rank} ({url}) refused it ({r.status}): {(await r.text())[:300]}"
            except (ClientError, asyncio.TimeoutError, OSError) as e:
                return f"rank {rank} ({url}) is not reachable ({type(e).__name__}: {e}); start it again (scripts/start-tp2.sh status)"

        return [p for p in await asyncio.gather(*(one(r, u) for r, u in self.followers)) if p]

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        if request.method != "POST" or request.path not in PROMPT_PATHS + CONTROL_PATHS:
            return await handler(request)
        if STATE.env.tp_rank != 0:
            return await self._follower(request, handler)
        response = await handler(request)
        if request.path in CONTROL_PATHS:
            problems = await self.forward(request.path, await _json(request))
            for p in problems:
                log.warning("%s could not repeat %s on a follower: %s", STATE.tag, request.path, p)
            return response
        if response.status != 200 or self.authorised(request):  # refused here, or a dual-submit copy (sent to all)
            return response
        prompt_id = json.loads(response.body)["prompt_id"]
        problems = await self.forward(request.path, dict(await _json(request), prompt_id=prompt_id))
        if not problems:
            return response
        why = "; ".join(problems)
        self.failed[prompt_id] = why
        _cancel_local(prompt_id)
        log.warning("%s prompt %s cancelled: %s", STATE.tag, prompt_id, why)
        error = {
            "type": "tp2_follower_unavailable",
            "message": f"Tensor-parallel ranks unavailable: {why}",
            "details": why,
            "extra_info": {},
        }
        return web.json_response({"error": error, "node_errors": {}}, status=503)

    async def _follower(self, request: web.Request, handler):
        if request.path in CONTROL_PATHS:
            return await handler(request)
        if not self.authorised(request):
            front = self.rank_urls[0] if self.rank_urls else "rank 0"
            message = (f"This ComfyUI is tensor-parallel rank {STATE.env.tp_rank} of {STATE.env.tp_size}, a follower: queue prompts on "
                       f"rank 0 ({front}); it runs them on every rank.")  # fmt: skip
            return web.json_response(
                {"error": {"type": "tp2_follower", "message": message, "details": message, "extra_info": {}}, "node_errors": {}}, status=403
            )
        # a restarted follower takes prompts only once its peers can see it restarted (its boot id is published)
        await asyncio.get_running_loop().run_in_executor(None, STATE.boot_registered.wait, 15.0)
        prompt_id = (await _json(request)).get("prompt_id")
        if prompt_id in self.seen:
            return web.json_response(self.seen[prompt_id])
        self.seen[prompt_id] = {"prompt_id": prompt_id, "number": -1, "node_errors": {}}  # claim it before awaiting
        response = await handler(request)
        if response.status == 200:
            self.seen[prompt_id] = json.loads(response.body)
            while len(self.seen) > 1000:
                self.seen.popitem(last=False)
        else:
            del self.seen[prompt_id]
        return response

    async def ranks(self, request: web.Request):
        return web.json_response({"tp_size": STATE.env.tp_size, "ranks": [{"rank": r, "url": u} for r, u in enumerate(self.rank_urls)]})


async def _json(request: web.Request) -> dict:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}


def _cancel_local(prompt_id: str) -> None:
    """Drop rank 0's copy: from the queue if it waits there; a running copy stops at its sampler rendezvous."""
    from server import PromptServer

    PromptServer.instance.prompt_queue.delete_queue_item(lambda item: item[1] == prompt_id)


FRONT_DOOR: FrontDoor | None = None


def install_front_door() -> FrontDoor | None:
    """Add the middleware and GET /tp2/ranks to ComfyUI's server (before it starts); None when no secret is set."""
    global FRONT_DOOR
    path = os.environ.get(ENV_SECRET_FILE)
    if not path:
        log.warning("%s %s is not set: the front door is off (every rank accepts prompts; submit to all ranks)", STATE.tag, ENV_SECRET_FILE)
        return None
    with open(path) as f:
        secret = f.read().strip()
    if len(secret) < 16:
        raise ValueError(
            f"{ENV_SECRET_FILE}={path} holds {len(secret)} characters; the launcher writes 64. Restart the ranks with scripts/start-tp2.sh."
        )
    urls = [u for u in os.environ.get(ENV_RANK_URLS, "").split(",") if u]
    if len(urls) != STATE.env.tp_size:
        raise ValueError(f"{ENV_RANK_URLS} lists {len(urls)} URLs for tp_size {STATE.env.tp_size}; the launcher sets one per rank.")
    from server import PromptServer

    FRONT_DOOR = FrontDoor(secret, urls)
    PromptServer.instance.app.middlewares.append(FRONT_DOOR.middleware)
    PromptServer.instance.routes.get("/tp2/ranks")(FRONT_DOOR.ranks)
    log.info(
        "%s front door on: %s",
        STATE.tag,
        "forwarding prompts to the followers" if STATE.env.tp_rank == 0 else f"prompts only from rank 0 ({urls[0]})",
    )
    return FRONT_DOOR


def forward_failure(prompt_id: str | None) -> str | None:
    """Why rank 0 cancelled this prompt (a follower could not take it), for the sampler rendezvous to stop at once."""
    return FRONT_DOOR.failed.get(prompt_id) if FRONT_DOOR and prompt_id else None
