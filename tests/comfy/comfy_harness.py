"""Real ComfyUI servers for tests: one process per rank, each with its own base directory (models, custom_nodes
with this pack and the tests' seams linked, input/output/temp/user, sqlite db), on loopback ports; and a small HTTP client.
The seams (fixtures/tp2_seams: faults, a broken int8 GEMM, nudged outputs, the memory taken as available) act only
when a test sets their TP2_TEST_* variables.

The ComfyUI checkout itself is never written to: everything a server writes lives under its base directory.
Which checkout: COMFYUI_DIR from conftest (the scripts' rule: $COMFYUI_DIR, else the one scripts/install.sh
remembered, else ~/ComfyUI).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid

from conftest import COMFYUI_DIR, free_port, have_comfyui  # noqa: F401 - the tests import these from here

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEAMS = os.path.join(ROOT, "tests", "comfy", "fixtures", "tp2_seams")


def link_pack(custom_nodes: str) -> None:
    """The pack, and beside it the tests' seams, linked into a server's custom_nodes."""
    for name, target in (("minimax-h3-tp2", ROOT), ("tp2_seams", SEAMS)):
        if not os.path.lexists(os.path.join(custom_nodes, name)):
            os.symlink(target, os.path.join(custom_nodes, name))


class Server:
    """One ComfyUI process. `env` adds environment variables (the TP ones, or none for a plain server)."""

    def __init__(
        self, base: str, models: dict[str, str], env: dict[str, str] | None = None, pack: bool = True, args=(), port: int | None = None
    ):
        self.base, self.port = base, port or free_port()
        self.follower = False  # a TP rank behind rank 0's front door: prompts are queued on rank 0 only
        for sub in ("custom_nodes", "input", "output", "temp", "user", "models/diffusion_models", "models/h3_conditioning"):
            os.makedirs(os.path.join(base, sub), exist_ok=True)
        if pack:
            link_pack(os.path.join(base, "custom_nodes"))
        for rel, src in models.items():
            dst = os.path.join(base, "models", rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            if not os.path.exists(dst):
                os.symlink(src, dst)
        self.log_path = os.path.join(base, "comfyui.log")
        cmd = [
            sys.executable, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(self.port), "--base-directory", base,
            "--database-url", f"sqlite:///{base}/comfyui.db", "--disable-auto-launch", "--disable-api-nodes", *args,
        ]  # fmt: skip
        full_env = {k: v for k, v in os.environ.items() if not k.startswith(("TP2_", "MASTER_"))}
        full_env.update(env or {})
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, cwd=COMFYUI_DIR, env=full_env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 90) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI on port {self.port} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                self.get("/system_stats")
                return
            except OSError:
                time.sleep(0.3)
        raise TimeoutError(f"ComfyUI on port {self.port} not ready after {timeout_s} s:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        with open(self.log_path, "rb") as f:
            return b"\n".join(f.read().splitlines()[-n:]).decode(errors="replace")

    def get(self, path: str):
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return json.loads(r.read())

    def post(self, path: str, body: dict):
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def submit(self, prompt: dict, prompt_id: str) -> None:
        status, body = self.post("/prompt", {"prompt": prompt, "prompt_id": prompt_id, "client_id": "tests"})
        if status != 200:
            raise AssertionError(f"port {self.port} refused the prompt ({status}): {body}")

    def wait_history(self, prompt_id: str, timeout_s: float = 120) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            h = self.get(f"/history/{prompt_id}")
            if prompt_id in h and h[prompt_id].get("status", {}).get("status_str") in ("success", "error"):
                return h[prompt_id]
            if self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI on port {self.port} died:\n{self.tail()}")
            time.sleep(0.1)
        raise TimeoutError(f"prompt {prompt_id} not finished on port {self.port} after {timeout_s} s:\n{self.tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.log.close()

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


def start_ranks(
    root: str, tp_size: int, models: dict[str, str], extra_env: dict[str, str] | None = None, args=(), front_door: bool = True,
    rank_env: dict[int, dict[str, str]] | None = None,
) -> list[Server]:  # fmt: skip
    """tp_size servers forming one TP world (ComfyUI arguments `args` added), started as scripts/start-tp2.sh starts
    them: followers first, rank 0's front door on (the run's secret and every rank's address), so a prompt is queued
    once on rank 0 (run_prompt does). `front_door=False`: the dual-submission mode, every rank given the prompt.
    `rank_env`: more variables for some ranks only (ranks started unlike each other)."""
    master, ports = free_port(), [free_port() for _ in range(tp_size)]
    env = {"TP2_WORLD_SIZE": str(tp_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master)}
    if front_door:
        secret = os.path.join(root, "secret")
        if os.path.exists(os.path.join(root, "rank0.queue.json")):
            os.remove(os.path.join(root, "rank0.queue.json"))  # a fresh start, as the launcher's: an empty queue
        with open(secret, "w") as f:
            f.write(uuid.uuid4().hex)
        env.update(TP2_SECRET_FILE=secret, TP2_RANK_URLS=",".join(f"http://127.0.0.1:{p}" for p in ports))
    servers = []
    for r in reversed(range(tp_size)):
        own = dict(env, TP2_RANK=str(r), **(extra_env or {}), **(rank_env or {}).get(r, {}))
        servers.insert(0, Server(os.path.join(root, f"rank{r}"), models, own, args=args, port=ports[r]))
        servers[0].follower = front_door and r > 0
    for s in servers:
        s.wait_ready()
    return servers


def stop_at_teardown(request, servers: list[Server], root: str) -> list[Server]:
    """Stop `servers` and remove `root` when the requesting fixture's scope ends; returns `servers`."""

    def stop():
        for s in servers:
            s.stop()
        cleanup(root)

    request.addfinalizer(stop)
    return servers


def servers_for(request, tmp_path_factory, models: dict[str, str], name: str, tp_size=None, env=None, pack=True) -> list[Server]:
    """A fixture's servers: `tp_size` TP ranks with `env`, or (tp_size None) one server without TP env."""
    root = str(tmp_path_factory.mktemp(name))
    if tp_size:
        servers = start_ranks(root, tp_size, models, env)
    else:
        servers = [Server(os.path.join(root, "plain"), models, env, pack=pack)]
        servers[0].wait_ready()
    return stop_at_teardown(request, servers, root)


def submit_once(servers: list[Server], prompt: dict, prompt_id: str) -> None:
    """Queue `prompt` under one id on every server that takes prompts: rank 0 of a TP set with a front door (it hands
    the prompt to its followers), every rank without one, and plain servers."""
    for s in servers:
        if not s.follower:
            s.submit(prompt, prompt_id)


def run_prompt(servers: list[Server], prompt: dict, timeout_s: float = 120) -> list[dict]:
    """submit_once, then each server's finished history entry."""
    pid = new_id()
    submit_once(servers, prompt, pid)
    return [s.wait_history(pid, timeout_s) for s in servers]


def assert_success(servers: list[Server], histories: list[dict]) -> None:
    for s, h in zip(servers, histories):
        assert h["status"]["status_str"] == "success", f"port {s.port}: {error_message(h)}\n{s.tail()}"


def tiny_base(root) -> str:
    """A ComfyUI --base-directory with this pack linked and the tiny int8 model, conditioning and VAE of the demo."""
    from conftest import make_checkpoint, make_tiny_h3

    base = os.path.join(str(root), "base")
    for sub in ("custom_nodes", "models/diffusion_models", "models/h3_conditioning", "models/vae"):
        os.makedirs(os.path.join(base, sub), exist_ok=True)
    link_pack(os.path.join(base, "custom_nodes"))
    make_checkpoint(os.path.join(base, "models/diffusion_models/h3_tiny_int8.safetensors"), "--int8")
    make_tiny_h3.main(["--conditioning", os.path.join(base, "models/h3_conditioning/h3_tiny_cond.safetensors")])
    make_tiny_h3.main(["--vae", os.path.join(base, "models/vae/h3_tiny_vae.safetensors")])
    return base


def launch(root, base: str, env: dict[str, str] | None = None, args=(), comfy_args=()) -> dict:
    """Two CPU ranks started by scripts/start-tp2.sh (the product's launcher, given `args` too, e.g. --split 3:1, and
    ComfyUI's `comfy_args` after its `--`); stop with stop_launched()."""
    run_dir, port = os.path.join(str(root), "ranks"), free_port()
    full_env = dict(os.environ, PYTHON=sys.executable, **(env or {}))
    cmd = [os.path.join(ROOT, "scripts", "start-tp2.sh"), "--comfyui", COMFYUI_DIR, "--tp-size", "2", "--cpu", "--run-dir", run_dir,
           "--base-dir", base, "--base-port", str(port), *args, "--", "--disable-api-nodes", *comfy_args]  # fmt: skip
    res = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    return {
        "run_dir": run_dir,
        "ports": [port, port + 1],
        "urls": [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"],
        "stdout": res.stdout,
    }


def stop_launched(launched: dict) -> subprocess.CompletedProcess:
    cmd = [os.path.join(ROOT, "scripts", "start-tp2.sh"), "stop", "--run-dir", launched["run_dir"]]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def call(url: str, path: str, body: dict | None = None, headers: dict | None = None, timeout: float = 60):
    """POST `body` as JSON (GET when None) to `url + path`: (status, parsed JSON answer), HTTP errors included."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def wait_done(url: str, prompt_id: str, timeout: float = 120) -> dict:
    """The history entry of `prompt_id` on the server at `url` once it succeeded or failed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = call(url, f"/history/{prompt_id}")[1].get(prompt_id)
        if h and h["status"].get("status_str") in ("success", "error"):
            return h
        time.sleep(0.1)
    raise TimeoutError(f"{prompt_id} not done on {url} after {timeout} s")


def wait_answers(url: str, timeout: float = 90) -> None:
    """Until the server at `url` answers (e.g. after the launcher started a rank again)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            call(url, "/system_stats", timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout} s")


def error_text(history: dict) -> str:
    """Every execution_error message of a history entry, joined."""
    return " ".join(str(d.get("exception_message", "")) for k, d in history["status"]["messages"] if k == "execution_error")


def error_message(history: dict) -> str:
    for kind, data in history.get("status", {}).get("messages", []):
        if kind == "execution_error":
            return f"{data.get('exception_type')}: {data.get('exception_message')}"
    return ""


def saved_sha256(output_dir: str, history: dict) -> dict[str, str]:
    """{relative path: sha256 of the bytes} of every file a finished prompt's nodes list in `output_dir`."""
    entries = [e for out in history.get("outputs", {}).values() for v in out.values() if isinstance(v, list) for e in v]
    paths = [os.path.join(e.get("subfolder", ""), e["filename"]) for e in entries if isinstance(e, dict) and e.get("type") == "output"]
    return {p: hashlib.sha256(open(os.path.join(output_dir, p), "rb").read()).hexdigest() for p in paths}


def output_files(server: Server, history: dict) -> dict[str, bytes]:
    """Every saved latent, image or conditioning file of a finished prompt: {relative path: bytes}."""
    out = {}
    for node_out in history.get("outputs", {}).values():
        for item in node_out.get("latents", []) + node_out.get("images", []) + node_out.get("conditioning", []):
            rel = os.path.join(item.get("subfolder", ""), item["filename"])
            with open(os.path.join(server.base, "output", rel), "rb") as f:
                out[rel] = f.read()
            _record_digest(server, rel, out[rel])
    return out


def _record_digest(server: Server, rel: str, blob: bytes) -> None:
    """With TP2_RECORD_DIGESTS=FILE, append each output's content digest (tensors by name, so a latent's per-process
    header order does not count): digests recorded before a refactor must not move after it."""
    path = os.environ.get("TP2_RECORD_DIGESTS")
    if not path:
        return
    import torch
    from safetensors.torch import load

    h = hashlib.sha256()
    if rel.endswith((".latent", ".safetensors")):
        for name, t in sorted(load(blob).items()):
            h.update(name.encode() + str(t.dtype).encode() + t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    else:
        h.update(blob)
    where = f"{os.environ.get('PYTEST_CURRENT_TEST', '?').split(' ')[0]} {os.path.basename(server.base)} {rel}"
    with open(path, "a") as f:
        f.write(json.dumps({"where": where, "sha256": h.hexdigest()}) + "\n")


def new_id() -> str:
    return str(uuid.uuid4())


def tiny_workflow(unet: str, cond: str, seed: int = 42, steps: int = 2, prefix: str = "tp2test", cfg: float = 1.0) -> dict:
    """Conditioning from file, EmptyMiniMaxH3LatentAV 64x64x5, KSampler, AV latent split and saved (no VAEs)."""
    return {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": unet, "weight_dtype": "default"}},
        "2": {"class_type": "LoadH3Conditioning", "inputs": {"file": cond}},
        "3": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["2", 0]}},
        "4": {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": {"width": 64, "height": 64, "length": 5}},
        "5": {"class_type": "KSampler", "inputs": {"model": ["1", 0], "seed": seed, "steps": steps, "cfg": cfg, "sampler_name": "euler",
                                                    "scheduler": "simple", "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0], "denoise": 1.0}},
        "6": {"class_type": "LTXVSeparateAVLatent", "inputs": {"av_latent": ["5", 0]}},
        "7": {"class_type": "SaveLatent", "inputs": {"samples": ["6", 0], "filename_prefix": f"latents/{prefix}_video"}},
        "8": {"class_type": "SaveLatent", "inputs": {"samples": ["6", 1], "filename_prefix": f"latents/{prefix}_audio"}},
    }  # fmt: skip


def demo_workflow(prefix: str, steps: int = 3, seed: int = 145) -> dict:
    """The bundled tiny API workflow (workflows/api/h3_tp2_tiny_demo.json) with its files saved under `prefix`."""
    with open(os.path.join(ROOT, "workflows", "api", "h3_tp2_tiny_demo.json")) as f:
        wf = json.load(f)
    wf["5"]["inputs"].update(steps=steps, seed=seed)
    wf["7"]["inputs"]["filename_prefix"] = f"latents/{prefix}_video"
    wf["8"]["inputs"]["filename_prefix"] = f"latents/{prefix}_audio"
    wf["11"]["inputs"]["filename_prefix"] = prefix
    return wf


def cleanup(path: str) -> None:
    """Remove a test's server directories (kept, logs and all, when TP2_KEEP_TEST_DIRS=1)."""
    if os.environ.get("TP2_KEEP_TEST_DIRS") != "1":
        shutil.rmtree(path, ignore_errors=True)


def venv_with_the_suites_packages(path: str) -> str:
    """A real virtualenv at `path` that sees this suite's packages (torch, ComfyUI's requirements, the pack's) through a
    .pth file, as a ComfyUI's own venv/ holds them, with nothing downloaded or copied; its python's path."""
    import sysconfig

    subprocess.run([sys.executable, "-m", "venv", path], check=True, timeout=120)
    py = os.path.join(path, "bin", "python")
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip
    with open(os.path.join(site, "suite_packages.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    return py
