"""The chunk budget beside decoding rows from measured step times (`ChunkPacer`), on the CPU: fed times, it keeps a
mixed step within `MIXED_STEP_LIMIT` times the rows' own step, never above the chunk the step graphs were captured
for nor below a share of it; it measures only steps the host waited for back to back. `plan_counts` spends a budget
on the prompts' next positions, beside decoding rows counting the step graph's padding. (The scheduler's chunks
following them: `test_paged_kv.py`.)"""

from __future__ import annotations

import pytest

from exporter.runtime.chunk_pacing import (
    MIXED_STEP_LIMIT,
    SMALLEST_SHARE,
    WAITED_S,
    ChunkPacer,
    chunk_cost,
    plan_counts,
)

ALONE_S = 0.0077  # the H100's 16-row decode step


def test_the_budget_keeps_a_mixed_step_within_the_limit_of_the_rows_own_step():
    pacer = ChunkPacer()
    assert pacer.budget(16, 384) == 384  # nothing measured: the largest budget
    pacer.measured(16, 0.0, ALONE_S)
    assert pacer.budget(16, 384) == 384  # no mixed step measured yet
    pacer.measured(16, 300.0, ALONE_S + 300 * 40e-6)  # 40 us a unit beside the rows
    allowed = (MIXED_STEP_LIMIT - 1) * ALONE_S / 40e-6
    assert pacer.budget(16, 384) == int(allowed) < 384
    assert pacer.budget(16, 100) == 100  # never above the captured chunk
    assert pacer.budget(8, 384) == int(allowed)  # 8 rows alone never measured: the nearest rows measured
    pacer.measured(8, 0.0, ALONE_S * 0.75)
    assert pacer.budget(8, 384) == int(allowed * 0.75)  # rows of a shorter step take a smaller chunk
    assert pacer.budget(12, 384) == int(allowed * 0.75)  # as near to 8 as to 16: the fewer rows, the smaller


def test_the_running_averages_follow_the_step_times():
    pacer = ChunkPacer()
    pacer.measured(16, 0.0, ALONE_S)
    pacer.measured(16, 200.0, ALONE_S + 200 * 20e-6)
    budgets = [pacer.budget(16, 400)]
    for _ in range(20):  # the chunk's keys get longer: each unit costs twice as much
        pacer.measured(16, 200.0, ALONE_S + 200 * 40e-6)
        budgets.append(pacer.budget(16, 400))
    assert all(a > b for a, b in zip(budgets[:3], budgets[1:4]))  # it moves at once
    assert budgets[-1] == pytest.approx((MIXED_STEP_LIMIT - 1) * ALONE_S / 40e-6, rel=0.01)
    pacer.measured(16, 200.0, ALONE_S / 2)  # faster than the rows alone (noise): no negative cost
    assert pacer.unit_s > 0
    for _ in range(40):
        pacer.measured(16, 200.0, 1.0)  # very slow mixed steps: a quarter of the largest chunk still
    assert pacer.budget(16, 384) == 384 // SMALLEST_SHARE == 96


def test_only_steps_the_host_waited_for_back_to_back_are_measured():
    pacer = ChunkPacer()
    wait = 2 * WAITED_S
    pacer.read_back(16, 0.0, 0.0, wait, next_queued=True)  # the first: nothing before it
    assert pacer.alone_s == {}
    pacer.read_back(16, 0.0, 0.005, 0.0077 + wait, next_queued=True)
    assert pacer.alone_s[16] == pytest.approx(0.0077)
    pacer.read_back(16, 0.0, 0.020, 0.020 + WAITED_S / 2, next_queued=True)  # done before the host read it
    pacer.read_back(16, 0.0, 0.021, 0.030, next_queued=True)  # the step before's end is not known
    assert pacer.alone_s[16] == pytest.approx(0.0077)
    pacer.read_back(16, 0.0, 0.031, 0.0377, next_queued=False)  # measured; nothing queued after it
    assert pacer.alone_s[16] == pytest.approx(0.0077)
    pacer.read_back(16, 0.0, 0.050, 0.060, next_queued=True)  # the device was idle before it: not measured
    pacer.read_back(0, 100.0, 0.061, 0.070, next_queued=True)  # no decode row: not measured
    assert pacer.alone_s == {16: pytest.approx(0.0077)} and pacer.unit_s is None


SIZES = (32, 64, 128, 256, 384)  # the step graphs' chunk sizes beside decoding rows (up to the 384 budget)


def test_without_padding_a_chunk_spends_its_budget_in_prompt_order():
    assert plan_counts([(0, 1000)], 200, float("inf")) == ([200], 200.0)
    assert plan_counts([(0, 50), (0, 1000)], 200, float("inf")) == ([50, 150], 200.0)
    counts, cost = plan_counts([(8000, 1000)], 200, 12_354.0)  # attention counted: fewer positions
    assert counts[0] < 200 and 0.95 * 200 < cost == chunk_cost(counts[0], 8000, 12_354.0) <= 200
    assert plan_counts([(100_000, 1000)], 200, 1000.0)[0] == [25]  # an eighth of the budget at least: it moves on


def test_with_the_graphs_sizes_the_padding_counts_and_a_chunk_fills_a_size():
    # 200 positions would run as 256 (cost 256 > 200): the chunk is the 128 below, whole
    assert plan_counts([(0, 1000)], 200, float("inf"), SIZES) == ([128], 128.0)
    assert plan_counts([(0, 1000)], 256, float("inf"), SIZES) == ([256], 256.0)
    # the prompt's end: 100 positions run as 128, which fits a budget of 130, not one of 110
    assert plan_counts([(900, 100)], 130, float("inf"), SIZES) == ([100], 128.0)
    assert plan_counts([(900, 100)], 110, float("inf"), SIZES) == ([64], 64.0)
    # two prompts share the padded size
    assert plan_counts([(0, 40), (0, 1000)], 200, float("inf"), SIZES) == ([40, 88], 128.0)
    # attention counted: the whole size whose cost fits
    counts, cost = plan_counts([(16_000, 1000)], 200, 12_354.0, SIZES)
    assert counts == [64] and cost == pytest.approx(chunk_cost(64, 16_000, 12_354.0))
    # nothing fits: at most the smallest size, so that the prompt moves on
    assert plan_counts([(100_000, 1000)], 40, 1000.0, SIZES)[0] == [5]
    # beyond the largest size a chunk runs eagerly, unpadded
    assert plan_counts([(0, 1000)], 500, float("inf"), SIZES) == ([500], 500.0)

