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
"""

from __future__ import annotations

# A step with a prompt chunk beside decoding rows: at most this many times their own step, so that their per-token
# p99 stays within 2x their own. Measured on the H100 (16 rows beside a 16k prompt, bench/paged_bench.py): at 1.7
# their p99 was 1.93x and the prompt's TTFT 2.34x its lone prefill; at 1.9 2.17x and 1.92x; at 2.0 2.19x and 1.83x.
MIXED_STEP_LIMIT = 1.7
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
