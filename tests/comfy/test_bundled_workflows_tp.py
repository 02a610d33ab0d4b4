"""The bundled text-to-video, image-to-video and first-last-frame workflows (workflows/api/) run end to end on TP2
and on one plain server (CPU, gloo), exactly as a user runs them: UNETLoader, CLIPLoader (type minimax), two
VAELoaders, MiniMaxH3ImageToVideo, KSampler, VAEDecode, VAEDecodeAudio, CreateVideo, SaveVideo to an MP4 with
real PyAV. The ranks' MP4 files are byte-identical.

Only the sizes change (64x64, 5 frames, 2 steps) and the models are small stand-ins with the real key names:
the tiny int8 DiT (scripts/make_tiny_h3.py), the tiny nvfp4 AWQ text encoder (scripts/make_tiny_qwen3vl.py,
built by ComfyUI at tiny widths through the test-only fixture h3_tiny_text_encoder), the small video VAE
(fixture h3_small_vae), and ComfyUI's own audio VAE class at its real size with random weights (151 M parameters).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from comfy_harness import COMFYUI_DIR, ROOT, Server, assert_success, have_comfyui, output_files, run_prompt, start_ranks, stop_at_teardown
from safetensors.torch import load

pytestmark = [pytest.mark.comfy, pytest.mark.skipif(not have_comfyui(), reason=f"no ComfyUI checkout with MiniMax-H3 at {COMFYUI_DIR}")]

FIXTURE_DIR = os.path.join(ROOT, "tests", "comfy", "fixtures")
FIXTURES = ("h3_small_vae", "h3_tiny_text_encoder")
TEST_ENV = {"H3_TEST_SMALL_VAE": "1", "H3_TEST_TINY_TE": "1"}
TP_ENV = {"TP2_PROMPT_TIMEOUT_S": "30", "TP2_TIMEOUT_S": "60", **TEST_ENV}
NAMES = {
    "unet": "h3_tiny_int8.safetensors",
    "clip": "h3_tiny_te_nvfp4.safetensors",
    "video_vae": "h3_small_video_vae.safetensors",
    "audio_vae": "h3_audio_vae_random.safetensors",
}
AUDIO_VAE_CODE = """
import comfy.cli_args as a; a.args.cpu = True
import torch, h3_small_vae
from comfy.ldm.minimax.audio_vae import MiniMaxH3AudioVAE
from safetensors.torch import save_file
vae = MiniMaxH3AudioVAE()
h3_small_vae.init_weights(vae, seed=1)
save_file({k: v.contiguous() for k, v in vae.state_dict().items()}, PATH)
"""


def _run(args, env=None, cwd=None):
    subprocess.run(args, check=True, timeout=600, env=env, cwd=cwd)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("wf_models"))
    path = {k: os.path.join(root, v) for k, v in NAMES.items()}
    _run([sys.executable, os.path.join(ROOT, "scripts", "make_tiny_h3.py"), path["unet"], "--int8"])
    _run([sys.executable, os.path.join(ROOT, "scripts", "make_tiny_qwen3vl.py"), path["clip"], "--format", "nvfp4"])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TP2_", "MASTER_"))}
    env.update(TEST_ENV, PYTHONPATH=os.pathsep.join([COMFYUI_DIR, FIXTURE_DIR]))
    vae = path["video_vae"]
    code = f"import comfy.cli_args as a; a.args.cpu = True; import h3_small_vae as m; m.write_checkpoint({vae!r}, seed=0)"
    _run([sys.executable, "-c", code], env=env, cwd=COMFYUI_DIR)
    _run([sys.executable, "-c", f"PATH = {path['audio_vae']!r}\n" + AUDIO_VAE_CODE], env=env, cwd=COMFYUI_DIR)
    return {
        f"diffusion_models/{NAMES['unet']}": path["unet"],
        f"text_encoders/{NAMES['clip']}": path["clip"],
        f"vae/{NAMES['video_vae']}": path["video_vae"],
        f"vae/{NAMES['audio_vae']}": path["audio_vae"],
    }


@pytest.fixture(scope="module")
def servers(request, tmp_path_factory, models):
    from PIL import Image

    root = str(tmp_path_factory.mktemp("wf"))
    for name in ("plain", "rank0", "rank1"):
        os.makedirs(os.path.join(root, name, "custom_nodes"))
        for fx in FIXTURES:
            os.symlink(os.path.join(FIXTURE_DIR, fx), os.path.join(root, name, "custom_nodes", fx))
    plain = Server(os.path.join(root, "plain"), models, TEST_ENV)
    ranks = start_ranks(root, 2, models, TP_ENV)
    plain.wait_ready()
    for i, which in enumerate(("first", "last")):  # the same images on every server
        pixels = (torch.rand(64, 64, 3, generator=torch.Generator().manual_seed(i)) * 255).to(torch.uint8).numpy()
        for s in (*ranks, plain):
            Image.fromarray(pixels).save(os.path.join(s.base, "input", f"h3_{which}_frame.png"))
    return stop_at_teardown(request, [*ranks, plain], root)


def bundled(name: str, prefix: str) -> dict:
    """The bundled API workflow with the small models, 64x64, 5 frames, 2 steps; every other input as shipped."""
    with open(os.path.join(ROOT, "workflows", "api", f"{name}.json")) as f:
        wf = json.load(f)
    for node in wf.values():
        inputs, kind = node["inputs"], node["class_type"]
        if kind == "UNETLoader":
            inputs["unet_name"] = NAMES["unet"]
        elif kind == "CLIPLoader":
            inputs["clip_name"] = NAMES["clip"]
        elif kind == "VAELoader":
            inputs["vae_name"] = NAMES["audio_vae"] if "audio" in inputs["vae_name"] else NAMES["video_vae"]
        elif kind == "MiniMaxH3ImageToVideo":
            inputs.update(width=64, height=64, length=5)
        elif kind == "KSampler":
            inputs["steps"] = 2
        elif kind == "SaveVideo":
            inputs["filename_prefix"] = f"video/{prefix}"
    return wf


@pytest.mark.parametrize("name", ["h3_tp2_t2v_832x480", "h3_tp2_i2v_832x480", "h3_tp2_flf2v_832x480"])
def test_bundled_workflow_runs_on_tp2_to_an_mp4(servers, name):
    r0, r1, plain = servers
    histories = run_prompt(servers, bundled(name, f"{name}_small"), 600)
    assert_success(servers, histories)
    files = [output_files(s, h) for s, h in zip(servers, histories)]
    videos = [{k: v for k, v in f.items() if k.endswith(".mp4")} for f in files]
    assert all(len(v) == 1 for v in videos), [list(f) for f in files]
    (a,), (b,), (c,) = (list(v.values()) for v in videos)
    assert a == b, f"{name}: the ranks' MP4 files differ ({len(a)} vs {len(b)} bytes): {_media_stage(r0, r1, histories)}"
    assert len(a) > 1000 and len(c) > 1000  # a real MP4 from PyAV on both the ranks and the plain server
    for s in (r0, r1):
        with open(s.log_path, errors="replace") as f:
            log = f.read()
        assert "text encode over 2 ranks" in log and "loaded text encoder h3_tiny_te_nvfp4.safetensors" in log


def _media_stage(r0, r1, histories) -> str:
    """tp2-submit's verdict on the two ranks' MP4 files: frames, audio or only the container."""
    from conftest import load_submit

    paths = []
    for s, h in zip((r0, r1), histories):
        (rel,) = [k for k in output_files(s, h) if k.endswith(".mp4")]
        paths.append(os.path.join(s.base, "output", rel))
    return load_submit().where_media_differ(*paths)


def test_a_lora_on_the_split_text_encoder_is_refused(servers):
    """ComfyUI would skip a full-shape patch on a rank's slice with a warning (TP silently without the LoRA): refused."""
    from comfy_harness import error_message
    from safetensors.torch import save_file

    r0, r1, _plain = servers
    key = "text_encoders.qwen3vl_32b.transformer.model.layers.0.self_attn.q_proj"
    lora = {f"{key}.lora_up.weight": torch.randn(512, 4), f"{key}.lora_down.weight": torch.randn(4, 128)}
    for s in (r0, r1):
        os.makedirs(os.path.join(s.base, "models", "loras"), exist_ok=True)
        save_file(lora, os.path.join(s.base, "models", "loras", "te_lora.safetensors"))
    wf = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": NAMES["unet"], "weight_dtype": "default"}},
        "2": {"class_type": "CLIPLoader", "inputs": {"clip_name": NAMES["clip"], "type": "minimax", "device": "default"}},
        "3": {"class_type": "LoraLoader", "inputs": {"model": ["1", 0], "clip": ["2", 0], "lora_name": "te_lora.safetensors",
                                                     "strength_model": 0.0, "strength_clip": 1.0}},
        "4": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["3", 1], "text": "a fox"}},
        "5": {"class_type": "SaveH3Conditioning", "inputs": {"conditioning": ["4", 0], "filename_prefix": "te_lora"}},
    }  # fmt: skip
    for s, h in zip((r0, r1), run_prompt([r0, r1], wf, 300)):
        assert h["status"]["status_str"] == "error", s.tail()
        assert "'model.layers.0.self_attn.q_proj.weight', which is split over the ranks" in error_message(h), error_message(h)


R2V_TEMPLATE = "video_minimax_h3_r2v.json"
SIZE_HELPERS = {"MarkdownNote", "ResolutionSelector", "ComfyMathExpression", "PrimitiveFloat"}


def r2v_graph(prefix: str) -> dict:
    """ComfyUI's own r2v template (pip package comfyui-workflow-templates) as an API prompt: its nodes and links,
    with the small models, two reference images, and width/height/length as constants (64x64, 5 frames, 2 steps)
    where the template computes them with ResolutionSelector / ComfyMathExpression / PrimitiveFloat."""
    return {
        "127": {"class_type": "UNETLoader", "inputs": {"unet_name": NAMES["unet"], "weight_dtype": "default"}},
        "128": {"class_type": "CLIPLoader", "inputs": {"clip_name": NAMES["clip"], "type": "minimax", "device": "default"}},
        "119": {"class_type": "VAELoader", "inputs": {"vae_name": NAMES["video_vae"]}},
        "120": {"class_type": "VAELoader", "inputs": {"vae_name": NAMES["audio_vae"]}},
        "137": {"class_type": "LoadImage", "inputs": {"image": "h3_first_frame.png"}},
        "139": {"class_type": "LoadImage", "inputs": {"image": "h3_last_frame.png"}},
        "138": {"class_type": "PrimitiveStringMultiline", "inputs": {"value": "Use <Picture 2> and <Picture 1> as reference frames: a fox in snow."}},
        "136": {"class_type": "MiniMaxH3ReferenceToVideo", "inputs": {
            "clip": ["128", 0], "vae": ["119", 0], "audio_vae": ["120", 0], "ref_images.ref_image_0": ["137", 0],
            "ref_images.ref_image_1": ["139", 0], "prompt": ["138", 0], "width": 64, "height": 64, "length": 5, "ref_image_size": "match"}},
        "129": {"class_type": "RandomNoise", "inputs": {"noise_seed": 42}},
        "123": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "res_multistep"}},
        "124": {"class_type": "BasicScheduler", "inputs": {"model": ["127", 0], "scheduler": "simple", "steps": 2, "denoise": 1.0}},
        "126": {"class_type": "BasicGuider", "inputs": {"model": ["127", 0], "conditioning": ["136", 0]}},
        "125": {"class_type": "SamplerCustomAdvanced", "inputs": {
            "noise": ["129", 0], "guider": ["126", 0], "sampler": ["123", 0], "sigmas": ["124", 0], "latent_image": ["136", 1]}},
        "122": {"class_type": "VAEDecode", "inputs": {"samples": ["125", 0], "vae": ["119", 0]}},
        "121": {"class_type": "VAEDecodeAudio", "inputs": {"samples": ["125", 0], "vae": ["120", 0]}},
        "130": {"class_type": "CreateVideo", "inputs": {"images": ["122", 0], "audio": ["121", 0], "fps": 24.0, "bit_depth": 8}},
        "92": {"class_type": "SaveVideo", "inputs": {"video": ["130", 0], "filename_prefix": f"video/{prefix}", "format": "auto", "codec": "auto"}},
    }  # fmt: skip


def test_comfyuis_r2v_template_runs_on_tp2(servers):
    import importlib.util

    spec = importlib.util.find_spec("comfyui_workflow_templates_json")
    if spec is None:
        pytest.skip("the pip package comfyui-workflow-templates (ComfyUI's requirements) is not installed")
    with open(os.path.join(os.path.dirname(spec.origin), "templates", R2V_TEMPLATE)) as f:
        template = json.load(f)
    wf = r2v_graph("h3_r2v_small")
    links = {(lk[1], lk[3]) for lk in template["links"]}
    nodes = {n["id"]: n["type"] for n in template["nodes"] if n["type"] not in SIZE_HELPERS}
    assert {int(k): v["class_type"] for k, v in wf.items()} == nodes  # the template's nodes, by id and type
    ours = {(int(v[0]), int(k)) for k, n in wf.items() for v in n["inputs"].values() if isinstance(v, list)}
    assert {lk for lk in links if lk[0] in nodes} == ours  # and its links between them
    histories = run_prompt(servers, wf, 600)
    assert_success(servers, histories)
    videos = [[v for k, v in output_files(s, h).items() if k.endswith(".mp4")] for s, h in zip(servers, histories)]
    assert len(videos[0]) == len(videos[1]) == 1 and videos[0] == videos[1], "the ranks' r2v MP4 files differ"


def _rank_dirs(root: str) -> str:
    for name in ("rank0", "rank1"):
        os.makedirs(os.path.join(root, name, "custom_nodes"))
        for fx in FIXTURES:
            os.symlink(os.path.join(FIXTURE_DIR, fx), os.path.join(root, name, "custom_nodes", fx))
    return root


def test_the_rank_cache_gives_the_same_video(models, tmp_path_factory):
    """TP2_RANK_CACHE=on (what 'auto' picks under ComfyUI's dynamic VRAM, which CPU servers lack): each rank cuts its
    slices of the DiT and of the text encoder into a file once and ComfyUI maps them from there; the sampler's output
    (video and audio latents) equals the shard-on-read ranks' tensor for tensor, the cached ranks' MP4s are identical,
    and a restarted rank maps the same files without cutting them again.

    The MP4 is not compared with the shard-on-read pair's: on these CPU servers the decoded frames of one workflow
    have differed between two runs, with or without the rank cache, while the latents matched (seen 2026-12-01 at
    3308314 and after; cause not found). The test prints whether the frames matched."""
    root = _rank_dirs(str(tmp_path_factory.mktemp("wf_cache")))
    cache = os.path.join(root, "cache")
    env = dict(TP_ENV, TP2_RANK_CACHE="on", TP2_CACHE_DIR=cache)
    wf = bundled("h3_tp2_t2v_832x480", "t2v_cache")
    wf["90"] = {"class_type": "LTXVSeparateAVLatent", "inputs": {"av_latent": ["8", 0]}}  # the sampler's output, saved
    wf["91"] = {"class_type": "SaveLatent", "inputs": {"samples": ["90", 0], "filename_prefix": "latents/t2v_cache_video"}}
    wf["92"] = {"class_type": "SaveLatent", "inputs": {"samples": ["90", 1], "filename_prefix": "latents/t2v_cache_audio"}}
    wf["93"] = {"class_type": "SaveImage", "inputs": {"images": ["9", 0], "filename_prefix": "frames/t2v_cache"}}
    shard_on_read = start_ranks(_rank_dirs(str(tmp_path_factory.mktemp("wf_reference"))), 2, models, TP_ENV)
    try:
        reference = run_prompt(shard_on_read, wf, 600)
        assert_success(shard_on_read, reference)
    finally:
        for s in shard_on_read:
            s.stop()
    cached = start_ranks(root, 2, models, env)
    try:
        histories = run_prompt(cached, wf, 600)
        assert_success(cached, histories)
        mp4s = []
        for s, h, ref_s, ref_h in zip(cached, histories, shard_on_read, reference):
            got, ref = output_files(s, h), output_files(ref_s, ref_h)
            latents = sorted(k for k in got if k.endswith(".latent"))
            assert len(latents) == 2 and latents == sorted(k for k in ref if k.endswith(".latent")), (sorted(got), sorted(ref))
            for k in latents:  # what the weights make: the sampler's output, tensor for tensor
                a, b = load(got[k]), load(ref[k])
                assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a), (
                    f"the rank cache changed the sampler's output ({k})"
                )
            mp4s.append([v for k, v in got.items() if k.endswith(".mp4")])
            # Not asserted: the decoded frames and the MP4 against the reference pair. On these CPU servers they have
            # differed between two runs of one workflow, with or without the rank cache (2026-12-01; cause not found).
            frames_equal = [v for k, v in got.items() if k.endswith(".png")] == [v for k, v in ref.items() if k.endswith(".png")]
            print(f"rank cache test, {s.base}: frames {'equal' if frames_equal else 'DIFFER'} to the shard-on-read pair's")
            with open(s.log_path, errors="replace") as f:
                log = f.read()
            assert f"loaded {NAMES['unet']} (rank cache " in log and f"loaded text encoder {NAMES['clip']} (rank cache " in log, s.tail()
            assert log.count("rank cache: wrote ") == 2, s.tail()
        assert len(mp4s[0]) == 1 and mp4s[0] == mp4s[1], f"the cached ranks' MP4 files differ: {_media_stage(*cached, histories)}"
        files = sorted(os.listdir(os.path.join(cache, "rank_cache")))
        assert len(files) == 4 and all(".tp2-rank" in f for f in files), files
    finally:
        for s in cached:
            s.stop()
    again = start_ranks(root, 2, models, env)
    try:
        assert_success(again, run_prompt(again, bundled("h3_tp2_t2v_832x480", "t2v_cache_again"), 600))
        for s in again:
            with open(s.log_path, errors="replace") as f:
                log = f.read()
            assert log.count("rank cache: wrote ") == 2, "a restarted rank cut its slices again"  # the log appends
    finally:
        for s in again:
            s.stop()


@pytest.fixture(scope="module")
def nudged(request, tmp_path_factory, models):
    """Two ranks of which rank 1 moves a few hundred values of every VAE decode up by one 8-bit step
    (TP2_TEST_NUDGE_RANKS), as a last-bit difference does to values next to a rounding step."""
    from safetensors.torch import save_file

    root = _rank_dirs(str(tmp_path_factory.mktemp("wf_nudged")))
    env = dict(TP_ENV, TP2_TEST_NUDGE_RANKS="1", TP2_PROMPT_TIMEOUT_S="10")
    ranks = start_ranks(root, 2, models, env, front_door=False)  # dual submission: rank 0's cache can be freed alone
    latent = torch.randn(1, 24, 2, 4, 4, generator=torch.Generator().manual_seed(7))  # one chunk: decoded on each rank
    for s in ranks:
        save_file({"latent_tensor": latent, "latent_format_version_0": torch.tensor([])}, os.path.join(s.base, "input", "h3_small.latent"))
    return stop_at_teardown(request, ranks, root)


def _log(server: Server) -> str:
    with open(server.log_path, errors="replace") as f:
        return f.read()


def test_a_rank_that_decodes_other_bytes_still_writes_the_same_mp4(nudged):
    """Identical by construction: rank 1's video and audio decodes are off in a few hundred values and its video file
    ends with one byte more, and the ranks' MP4s are still byte-identical, because every rank takes rank 0's
    decode and file where the bytes differ (with either comparison off, the MP4s differ)."""
    histories = run_prompt(nudged, bundled("h3_tp2_t2v_832x480", "t2v_nudged"), 600)
    assert_success(nudged, histories)
    mp4s = [[v for k, v in output_files(s, h).items() if k.endswith(".mp4")] for s, h in zip(nudged, histories)]
    assert len(mp4s[0]) == 1 and mp4s[0] == mp4s[1], f"the ranks' MP4 files differ: {_media_stage(*nudged, histories)}"
    for s in nudged:
        log = _log(s)
        for stage in ("MiniMaxH3VideoVAE decode", "MiniMaxH3AudioVAE decode"):
            assert f"{stage}: rank(s) 1 decoded other bytes than rank 0; every rank now has rank 0's output" in log, s.tail()
        assert "SaveVideo files: rank(s) 1 wrote other bytes than rank 0; every rank now has rank 0's files" in log, s.tail()


def _decode_only(prefix: str) -> dict:
    return {
        "1": {"class_type": "LoadLatent", "inputs": {"latent": "h3_small.latent"}},
        "2": {"class_type": "VAELoader", "inputs": {"vae_name": NAMES["video_vae"]}},
        "3": {"class_type": "VAEDecode", "inputs": {"samples": ["1", 0], "vae": ["2", 0]}},
        "4": {"class_type": "SaveImage", "inputs": {"images": ["3", 0], "filename_prefix": f"frames/{prefix}"}},
    }


def test_a_peer_that_never_joins_the_decode_leaves_the_output_as_it_is_then_the_next_prompt_is_identical(nudged):
    """Rank 0's node cache is cleared alone, so only it decodes (rank 1's cache serves the decode): rank 0 finishes
    on its own and says its output may differ; the next prompt clears both caches and is identical again."""
    r0, r1 = nudged
    first = run_prompt(nudged, _decode_only("alone"), 300)
    assert_success(nudged, first)
    r0.post("/free", {"free_memory": True})  # no front door in this world: rank 0 alone
    time.sleep(1.0)
    second = run_prompt(nudged, _decode_only("alone"), 300)
    assert_success(nudged, second)
    assert "may differ from the other ranks'" in _log(r0), r0.tail()
    third = run_prompt(nudged, _decode_only("again"), 300)
    assert_success(nudged, third)
    frames = [{k: v for k, v in output_files(s, h).items() if k.endswith(".png")} for s, h in zip(nudged, third)]
    assert frames[0] and frames[0] == frames[1], "the ranks' frames differ after the caches were cleared"
    assert _log(r1).count("MiniMaxH3VideoVAE decode: rank(s) 1 decoded other bytes than rank 0") >= 2, r1.tail()
