"""tp2/settings.py is the one place settings live: the launcher's defaults and docs/SETTINGS.md agree with it, no
pack module reads the environment itself nor names a test or benchmark seam (those live with the tests and the
benchmarks), and bad values are refused with one error type that says what the variable does."""

from __future__ import annotations

import os
import re

import pytest

from tp2 import settings
from tp2.settings import SETTINGS, SettingError, value

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _same(a: str, b: str) -> bool:
    try:
        return float(a) == float(b)
    except ValueError:
        return a == b


def test_the_launcher_defaults_are_the_settings_defaults():
    text = open(os.path.join(ROOT, "scripts", "start-tp2.sh")).read()
    found = dict(re.findall(r'^: "\$\{(\w+):=([^}]*)\}"', text, flags=re.M))  # the defaults block, not --fast's line
    launcher = {n for n, s in SETTINGS.items() if s.launcher}
    assert set(found) == launcher, set(found) ^ launcher
    for name, default in found.items():
        assert _same(default, SETTINGS[name].default), (name, default, SETTINGS[name].default)


def test_no_pack_module_reads_the_environment_itself():
    offenders = []
    for folder in ("nodes", "tp2", "kernels"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in files:
                path = os.path.join(dirpath, f)
                if not f.endswith(".py") or path.endswith(os.path.join("tp2", "settings.py")):
                    continue
                for i, line in enumerate(open(path), 1):
                    # Triton's own TRITON_INTERPRET is read where the probe needs it (kernels/ cannot import tp2)
                    reads = ("os.environ" in line or "os.getenv" in line) and "TRITON_INTERPRET" not in line
                    if reads or "TP2_TEST_" in line or "TP2_BENCH_" in line:
                        offenders.append(f"{os.path.relpath(path, ROOT)}:{i}")
    assert not offenders, offenders


@pytest.mark.parametrize(
    "name,raw,says",
    [
        ("TP2_SEQUENCE_PARALLEL", "yes", "TP2_SEQUENCE_PARALLEL='yes' must be 1 (DiT blocks split the token rows over the ranks) or 0"),
        ("TP2_REDUCE_DTYPE", "fp16", "TP2_REDUCE_DTYPE='fp16' is not one of fp32, bf16"),
        ("MASTER_PORT", "0", "MASTER_PORT=0 must be from 1 to 65535"),
        ("TP2_SP_CHUNK_ROWS", "two", "TP2_SP_CHUNK_ROWS='two' must be a whole number"),
        ("TP2_PROMPT_TIMEOUT_S", "-1", "TP2_PROMPT_TIMEOUT_S=-1.0 must be at least"),
    ],
)
def test_bad_values_are_refused_saying_what_the_variable_does(name, raw, says):
    with pytest.raises(SettingError, match=re.escape(says)):
        value(name, {name: raw})


def test_typed_values_and_defaults():
    assert value("TP2_SEQUENCE_PARALLEL", {}) is False and value("TP2_SEQUENCE_PARALLEL", {"TP2_SEQUENCE_PARALLEL": "on"}) is True
    assert value("TP2_SP_CHUNK_ROWS", {"TP2_SP_CHUNK_ROWS": " 4 "}) == 4 and value("TP2_TIMEOUT_S", {}) == 300.0
    assert value("TP2_RANK_URLS", {"TP2_RANK_URLS": "http://a,http://b"}) == ["http://a", "http://b"]
    assert value("TP2_SECRET_FILE", {}) is None and value("TP2_BLOCK_MS", {}) == []
    assert settings.cache_dir({"TP2_CACHE_DIR": "/x"}) == "/x"


def test_a_frozen_snapshot_answers_every_read_after_activation(monkeypatch):
    """After freeze() (a rank's activation), value() answers from the snapshot: a later change of the environment
    does not reach a running rank; an explicit environ is still parsed; a bad value is refused at the freeze."""
    monkeypatch.setattr(settings, "_FROZEN", None)
    monkeypatch.setenv("TP2_SP_CHUNK_ROWS", "4096")
    frozen = settings.freeze()
    monkeypatch.setenv("TP2_SP_CHUNK_ROWS", "8192")
    assert value("TP2_SP_CHUNK_ROWS") == 4096 == frozen["TP2_SP_CHUNK_ROWS"]
    assert value("TP2_SP_CHUNK_ROWS", {"TP2_SP_CHUNK_ROWS": "8192"}) == 8192
    with pytest.raises(TypeError):
        frozen["TP2_SP_CHUNK_ROWS"] = 1  # read-only
    monkeypatch.setenv("TP2_SP_CHUNK_ROWS", "many")
    with pytest.raises(SettingError, match="TP2_SP_CHUNK_ROWS='many' must be a whole number"):
        settings.freeze()


def test_docs_settings_is_generated_from_the_table():
    with open(os.path.join(ROOT, "docs", "SETTINGS.md")) as f:
        assert f.read() == settings.markdown(), "docs/SETTINGS.md is stale: run `python -m tp2.settings > docs/SETTINGS.md`"
