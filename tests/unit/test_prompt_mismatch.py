"""Two ranks given different prompts are refused with the difference named by node and key, a `_meta` title
as plainly as an input (tp2.handshake.prompt_details, compare_fields)."""

from __future__ import annotations

import pytest

from tp2.errors import RankMismatchError
from tp2.handshake import compare_fields, detail_key, prompt_details


def _fields(prompt: dict) -> dict[str, str]:
    return {"prompt": str(hash(repr(prompt))), detail_key("prompt"): prompt_details(prompt)}


@pytest.mark.parametrize(
    "change,named",
    [
        (lambda n: n["inputs"].update(seed=2), "node 5 (KSampler) input 'seed' (rank 0: 1, rank 1: 2)"),
        (lambda n: n["_meta"].update(title="Other"), 'node 5 (KSampler) _meta (rank 0: {"title": "KSampler"}, rank 1: {"title": "Other"})'),
    ],
    ids=["input", "meta"],
)
def test_a_difference_is_named_by_node_and_key(change, named):
    a = {"5": {"class_type": "KSampler", "inputs": {"seed": 1}, "_meta": {"title": "KSampler"}}}
    b = {"5": {"class_type": "KSampler", "inputs": {"seed": 1}, "_meta": {"title": "KSampler"}}}
    change(b["5"])
    with pytest.raises(RankMismatchError) as e:
        compare_fields([_fields(a), _fields(b)], "[tp2 r0/2]", "prompt 'p/0'")
    assert named in str(e.value), str(e.value)
