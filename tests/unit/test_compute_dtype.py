"""The compute dtype per simulated compute capability (tp2.compute_dtype), and capacity per dtype."""

import pytest
import torch

from kernels import attention
from kernels.attention import sdpa_materialises_scores
from tp2 import capacity, settings
from tp2.compute_dtype import choose_compute_dtype


@pytest.mark.parametrize(
    "cc, want, why",
    [((7, 5), "fp32", "7.5 < 8.0 has no bf16 tensor cores"), ((8, 6), "bf16", "8.6 >= 8.0"),
     ((8, 9), "bf16", "8.9 >= 8.0"), ((9, 0), "bf16", "9.0 >= 8.0"), (None, "fp32", "no CUDA GPU")],
)  # fmt: skip
def test_auto_picks_per_capability(cc, want, why):
    dtype, reason = choose_compute_dtype(cc)
    assert dtype == want and why in reason


@pytest.mark.parametrize("cc", [(7, 5), (8, 6), (8, 9), (9, 0)])
@pytest.mark.parametrize("setting", ["fp32", "bf16"])
def test_setting_overrides_and_says_so(cc, setting):
    assert choose_compute_dtype(cc, setting) == (setting, f"TP2_COMPUTE_DTYPE={setting}")


def test_unknown_setting_is_refused():
    with pytest.raises(settings.SettingError, match="TP2_COMPUTE_DTYPE='fp16' is not one of auto, fp32, bf16"):
        settings.value("TP2_COMPUTE_DTYPE", {"TP2_COMPUTE_DTYPE": "fp16"})


@pytest.mark.parametrize("streamed", [False, True])
def test_fp32_needs_more_and_fits_shorter(streamed):
    n = capacity.tokens(1920, 1088, 124)
    bf16, fp32 = (capacity.predict_peak_gib(n, 2, streamed=streamed, dtype=d) for d in ("bf16", "fp32"))
    assert fp32 > bf16 * 1.1
    longest = [capacity.longest_frames(1920, 1088, 22, 2, streamed=streamed, dtype=d) for d in ("bf16", "fp32")]
    assert longest[1] < longest[0]


def test_cli_names_the_dtype(capsys):
    capacity.main(["--gpu-mem", "22", "--dtype", "fp32"])
    assert "fp32 compute" in capsys.readouterr().out


@pytest.mark.parametrize(
    "cc, dtype, math_path",
    [((7, 5), torch.bfloat16, True), ((7, 5), torch.float32, False), ((7, 5), torch.float16, False),
     ((8, 6), torch.bfloat16, False), ((8, 9), torch.bfloat16, False), ((9, 0), torch.float32, False)],
)  # fmt: skip
def test_sdpa_math_path_per_capability(cc, dtype, math_path):
    assert sdpa_materialises_scores(cc, dtype) is math_path


def test_auto_attention_never_keeps_sdpa_on_its_math_path(monkeypatch, caplog):
    """Simulated sm_75 in bf16: auto drops SDPA (its math path) without timing it, and says why."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    fn = lambda q, k, v, heads: q  # noqa: E731 - a candidate that runs; only the choice is under test
    device = torch.device("cuda", 7)  # never touched: with one candidate left no timing runs
    with caplog.at_level("INFO"):
        assert attention.select_attention({"sdpa": (fn, ""), "ck": (fn, "")}, device, "auto", dtype=torch.bfloat16) == "ck"
    assert "sdpa: math path for torch.bfloat16 on compute capability (7, 5)" in caplog.text
