"""scripts/tp2-submit refuses bad input before it reaches any rank (exit 2), saying what is wrong: a workflow file that
is not valid JSON (named, with where it breaks), and a --set of an input the node does not have (a typo would be sent,
ignored by ComfyUI, and the run would look fine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import ROOT, load_submit

SUBMIT = os.path.join(ROOT, "scripts", "tp2-submit")
TINY = os.path.join(ROOT, "workflows", "api", "h3_tp2_tiny_demo.json")


def _submit(*args: str) -> subprocess.CompletedProcess:
    # ports no rank listens on: each refusal must come before any connection
    return subprocess.run([sys.executable, SUBMIT, *args, "--ports", "1,2"], capture_output=True, text=True, timeout=60)


def test_a_cut_json_file_is_named_as_not_valid_json(tmp_path):
    cut = tmp_path / "cut.json"
    cut.write_text(open(TINY).read()[:40])
    res = _submit(str(cut))
    assert res.returncode == 2, res.stderr
    assert f"'{cut}' is not valid JSON (" in res.stderr and "at line " in res.stderr and "Export (API)" in res.stderr, res.stderr


def test_set_of_an_input_the_node_lacks_is_refused_naming_its_inputs():
    res = _submit(TINY, "--set", "KSampler.sed=7")
    assert res.returncode == 2, res.stdout + res.stderr
    inputs = next(n["inputs"] for n in json.load(open(TINY)).values() if n["class_type"] == "KSampler")
    assert "--set 'KSampler.sed=7': node 5 (KSampler) has no input 'sed' (did you mean 'seed'?)" in res.stderr, res.stderr
    assert f"its inputs: {', '.join(inputs)}." in res.stderr and "seed" in inputs, res.stderr


def test_set_of_an_existing_input_by_class_or_id_changes_only_that_input():
    prompt = json.load(open(TINY))
    before = json.loads(json.dumps(prompt))
    load_submit().apply_sets(prompt, ["KSampler.seed=7", "5.steps=3", 'KSampler.sampler_name="euler"'])
    assert prompt["5"]["inputs"]["seed"] == 7 and prompt["5"]["inputs"]["steps"] == 3 and prompt["5"]["inputs"]["sampler_name"] == "euler"
    for key in ("seed", "steps", "sampler_name"):
        before["5"]["inputs"][key] = prompt["5"]["inputs"][key]
    assert prompt == before
