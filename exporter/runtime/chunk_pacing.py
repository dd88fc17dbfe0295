"""The prompt chunk beside decoding rows, sized from the steps' measured times.

A step that carries a prompt chunk beside decoding rows delays every row's next token by the chunk's cost. The
scheduler reads each step's tokens back in order, and the device runs the steps back to back (the next one is
queued before the host waits for the current one), so when the host had to wait for both of two successive
steps, the time between its two reads is the second step's time on the device: no extra synchronization, only
host clocks read around reads the scheduler makes anyway. ``ChunkPacer`` keeps running averages of the time of a
step of the current rows alone and of a mixed step's extra time per unit of chunk cost (``chunk_cost``), and gives
the budget that keeps a mixed step within ``MIXED_STEP_LIMIT`` times the rows' own step, never above the budget the
step graphs were captured for, nor below a share of it (the time per unit is measured at the current chunk, a
step's fixed costs counted in: a smaller chunk measures a higher cost per unit, a larger budget follows, and the
budget settles where the step takes the limit; the floor keeps a burst of slow steps from starving the prompt).

``plan_counts`` spends a budget on the waiting prompts' next positions. Beside decoding rows a step graph computes
the chunk's products for its padded size (the next chunk size captured), so there the padding counts in the cost:
the chunk is the largest whose padded cost fits, a whole captured size where the prompt goes on, and the pacer
measures what the device computed (a chunk just past a size's edge no longer costs a whole size more than planned).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..llm.config import DecoderConfig

# A step with a prompt chunk beside decoding rows: at most this many times their own step, so that their per-token
# p99 stays within 2x their own. Measured on an H200 before ``plan_counts`` counted the padding (16 rows beside a 16k
# prompt, bench/paged_bench.py): at 1.7 their p99 was 2.00x and the prompt's TTFT 2.82x its lone prefill, the steps
# overshooting where a chunk crossed a graph size's edge. The same pacing replayed over that run's measured steps
# (``paced_schedule``) gives 2.04x and 2.75x as it was, and with the padding counted 1.90x and 2.21x at 1.9.
MIXED_STEP_LIMIT = 1.9
SAMPLE_WEIGHT = 0.25  # a new measurement's weight in the running averages (the last few steps count most)
WAITED_S = 50e-6  # a read back that took this long waited for the device: the step had just finished
SMALLEST_SHARE = 4  # the budget stays at least this fraction (1/n) of the largest chunk: a long prompt moves on


def _average(running: float | None, sample: float) -> float:
    return sample if running is None else running + SAMPLE_WEIGHT * (sample - running)


class ChunkPacer:
    """The chunk budget beside decoding rows from measured step times (see the module docstring): until a step of
    the same rows alone and a mixed step were measured, the largest budget allowed."""

    def __init__(self, limit: float = MIXED_STEP_LIMIT):
        self.limit = limit
        self.alone_s: dict[int, float] = {}  # decode rows -> running time of a step of them alone
        self.unit_s: float | None = None  # running extra time of a mixed step per unit of chunk cost
        self._done_at: float | None = None  # when the step read back last finished (None: not known)

    def read_back(self, rows: int, cost: float, waited_from: float, done_at: float, next_queued: bool) -> None:
        """A step of ``rows`` decode rows and a chunk of ``cost`` units was read back: the host started to wait at
        ``waited_from`` and had its tokens at ``done_at`` (host clock, seconds); ``next_queued``: a step after it
        was already queued (the device went on without a gap). Measures the step if the host waited for it and for
        the step before."""
        waited = done_at - waited_from >= WAITED_S
        previous, self._done_at = self._done_at, (done_at if waited and next_queued else None)
        if waited and previous is not None and rows:
            self.measured(rows, cost, done_at - previous)

    def measured(self, rows: int, cost: float, seconds: float) -> None:
        """One step of ``rows`` decode rows and a chunk of ``cost`` units took ``seconds`` on the device."""
        if not cost:
            self.alone_s[rows] = _average(self.alone_s.get(rows), seconds)
        elif rows in self.alone_s:
            self.unit_s = _average(self.unit_s, max(seconds - self.alone_s[rows], 0.0) / cost)

    def budget(self, rows: int, most: int) -> int:
        """The chunk cost a step beside ``rows`` decoding rows may take: what keeps it within ``limit`` times their
        step alone (or, never measured alone, the nearest number of rows measured), at least ``most /
        SMALLEST_SHARE`` and at most ``most``."""
        if not self.alone_s or not self.unit_s:
            return most
        alone = self.alone_s[min(self.alone_s, key=lambda measured: (abs(measured - rows), measured))]
        return max(1, most // SMALLEST_SHARE, min(most, int((self.limit - 1.0) * alone / self.unit_s)))


def chunk_cost(count: int, start: int, key_equivalent: float) -> float:
    """What prefilling positions ``[start, start + count)`` costs, in prompt positions of matrix products: each
    position costs one, plus its attention to the keys before it (on average ``start + count / 2``), at
    ``key_equivalent`` keys per position."""
    return count * (1.0 + (start + count / 2) / key_equivalent)


ATTENTION_COST = 2.0  # a chunk's attention runs at about half the rate of its matrix products (an estimate)


def attention_key_equivalent(config: DecoderConfig) -> float:
    """How many keys one position attends to for the cost of its matrix products: the multiply-adds of a layer's
    weights per position over the ``2 x heads x head_dim`` per key (scores and values), at ``ATTENTION_COST``."""
    hidden, heads, groups, dim = config.hidden_size, config.num_attention_heads, config.num_query_groups, \
        config.head_dim
    ffn = config.expert_ffn_hidden_size if config.num_moe_experts else config.ffn_hidden_size
    experts = config.moe_router_topk if config.num_moe_experts else 1
    weights = hidden * (heads + 2 * groups) * dim + heads * dim * hidden \
        + experts * ffn * hidden * (3 if config.gated else 2)
    return weights / (2 * heads * dim * ATTENTION_COST)


def plan_counts(prompts: Sequence[tuple[int, int]], budget: int, key_equivalent: float,
                padded_sizes: Sequence[int] = ()) -> tuple[list[int], float]:
    """How many positions of each prompt, given in order as (first position to prefill, positions left), one step
    prefills within ``budget`` ``chunk_cost`` units (a piece keeps at least an eighth of the budget, so that a long
    prompt moves on), and the cost they spend. With ``padded_sizes`` (ascending; a chunk of up to the largest
    computes its products for the next size up), the padding counts in that cost and the chunk is the largest
    whose padded cost fits, or at most the smallest size."""
    counts, cost = _fill(prompts, budget, key_equivalent, math.inf)
    total = sum(counts)
    if not padded_sizes or not total or total > padded_sizes[-1]:
        return counts, cost
    for size in reversed([size for size in padded_sizes if size <= padded_size(total, padded_sizes)]):
        counts, cost = _fill(prompts, budget, key_equivalent, size)
        padding = padded_size(sum(counts), padded_sizes) - sum(counts)
        if cost + padding <= budget or size == padded_sizes[0]:
            break
    return counts, cost + padding


def padded_size(total: int, sizes: Sequence[int]) -> int:
    """The size a chunk of ``total`` positions is computed for: the first of ``sizes`` (ascending) at least it."""
    return next(size for size in sizes if size >= total)


def _fill(prompts: Sequence[tuple[int, int]], budget: int, key_equivalent: float,
          room: float) -> tuple[list[int], float]:
    """``plan_counts`` without padding, the chunk at most ``room`` positions."""
    smallest = max(1, budget // 8)
    remaining, cost = float(budget), 0.0
    counts: list[int] = []
    for start, left in prompts:
        if remaining < 1 or room < 1:
            break
        count = int(min(left, remaining, room))
        while count > smallest and chunk_cost(count, start, key_equivalent) > remaining:
            count = max(smallest, int(count * remaining / chunk_cost(count, start, key_equivalent)))
        spent = chunk_cost(count, start, key_equivalent)
        remaining, cost, room = remaining - spent, cost + spent, room - count
        counts.append(count)
    return counts, cost
