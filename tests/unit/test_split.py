"""tp2.split: parsing `--split`, cutting a width by the shares, the nearest workable shares."""

from __future__ import annotations

import os

import pytest

from tp2.errors import PlanError
from tp2.split import counts, cut, parse_split, workable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_parse_split_reads_one_positive_share_per_rank():
    assert parse_split("3:2", 2) == (3, 2)
    assert parse_split("1:2:3:4", 4) == (1, 2, 3, 4)
    assert parse_split("", 3) == (1, 1, 1) and parse_split(None, 2) == (1, 1)


@pytest.mark.parametrize("text", ["3:2:1", "3", "3:0", "0:0", "a:b", "3:-1", "1.5:1", "3:2:"])
def test_parse_split_refuses_with_an_example(text):
    with pytest.raises(PlanError, match=r"not 2 positive whole numbers .* e\.g\. 3:2"):
        parse_split(text, 2)


def test_cut_even_shares_need_a_divisible_width():
    assert cut(12, 4, (1, 1)) == (0, 6, 12)
    assert cut(12, 4, (2, 2, 2)) == (0, 4, 8, 12)
    assert cut(10, 1, (1, 1, 1)) is None  # even shares never round: exactly the split before shares existed


def test_cut_uneven_shares_deal_whole_units():
    assert cut(20, 4, (3, 2)) == (0, 12, 20)  # 5 units: 3 and 2
    assert cut(18, 4, (3, 2)) is None  # not whole units
    assert cut(28 * 256, 256, (17, 11)) == (0, 17 * 256, 28 * 256)


def test_cut_rounds_by_largest_remainder_ties_to_the_lower_rank():
    assert counts(10, (1, 1, 1)) == [4, 3, 3]
    assert counts(7, (3, 2)) == [4, 3]  # 4.2 and 2.8: the .8 gets the spare unit
    assert cut(7, 1, (3, 2)) == (0, 4, 7)


def test_cut_refuses_a_rank_left_without_a_unit():
    assert cut(3 * 64, 64, (10, 1)) is None  # 3 units at 10:1 leave rank 1 none
    assert cut(12 * 64, 64, (10, 1)) == (0, 11 * 64, 12 * 64)


def test_workable_gives_every_rank_a_unit():
    assert workable(3, (10, 1)) == (2, 1)
    assert workable(4, (1, 1, 10)) == (1, 1, 2)
    assert workable(28, (3, 2)) == (17, 11)


def test_fewer_units_than_ranks_is_refused_not_searched_for_ever():
    """workable() moved the only unit between the ranks for ever (issue 39); now it refuses, and the plan's refusal
    names the width."""
    with pytest.raises(PlanError, match=r"1 whole unit\(s\) cannot give each of 2 ranks one"):
        workable(1, (3, 1))
    from tp2.split import refusal

    assert refusal((3, 1), "DiT's heads", 8, 8) == (
        "The split 3:1 leaves a rank no whole unit of the DiT's heads (8 = 1 units of 8). "
        "No uneven split of 2 ranks can: leave --split out (the even split), or use at most 1 rank(s)."
    )
