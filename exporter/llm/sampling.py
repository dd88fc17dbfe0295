"""Every row's next token chosen on the device in one pass: greedy, sampled and beam-search rows side by side.

A :class:`TokenChooser` keeps one column of state per KV-cache row in fixed-shape tensors: the row's next input token
and position, its sampling parameters, the tokens it has seen (for the repetition penalty), its beam's score and
parent row. ``choose`` reads a step's logits and leaves each row's next token and position there, with static shapes
and no host synchronisation, so it can be captured in a CUDA graph with the decode step and the next step can be
queued before the host has read this one.

Semantics are TensorRT-LLM's (see ``generate``): repetition penalty → temperature → top-k → top-p → sample. A
sampled row draws with an exponential race (``argmax(p / E)``, ``E ~ Exp(1)``), its noise a counter-based hash of
(seed, position, vocab id): a request draws the same tokens whatever rows share its batch.

A beam search of width ``w`` holds ``w`` consecutive rows, its leader first. Each beam row offers its best ``2W``
continuations (``W`` the widest beam search served), the leader takes the group's best ``2w`` by summed
log-probability, and the group's rows continue the best ``w`` that are neither an end token nor impossible
(stop strings are the host's: it reads the candidates back and corrects the rare step they change). A beam's
parent row is recorded for the caller to copy that row's KV cache before the next step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

# rows of TokenChooser.ints
TOKEN, POSITION, ACTIVE, GREEDY, TOP_K, SEED_LO, SEED_HI, WIDTH, OFFSET, PARENT = range(10)
# rows of TokenChooser.floats
TEMPERATURE, TOP_P, PENALTY, SCORE = range(4)

_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class RowSetup:
    """What a request's row starts with: its sampling parameters, where it stands and its place in a beam search.

    ``token`` at ``position`` is the row's latest token: the next step's input, or, for a prompt just prefilled
    (its last position; the token unused), the one after which ``choose`` picks from the prefill's logits. ``width``
    and ``offset`` place the row in its request's beam group (1 and 0 for a single sequence); ``score`` is the
    beam's summed log-probability so far.
    """

    greedy: bool
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    seed: int
    position: int
    width: int = 1
    offset: int = 0
    score: float = 0.0
    token: int = 0


def host_to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A tensor of ``values`` on ``device``; on CUDA copied from pinned memory without waiting for queued work."""
    return moved_without_waiting(torch.tensor(values, dtype=dtype), device)


def moved_without_waiting(tensor: Tensor, device: torch.device) -> Tensor:
    """A CPU ``tensor`` on ``device``; on CUDA copied from pinned memory, not waiting for the device's queued work."""
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


class TokenChooser:
    """Per-row decoding state of ``rows`` KV-cache rows and the pass that picks every row's next token.

    ``max_beam_width`` fixes the candidate count (``2 × max_beam_width`` per row); 1 builds no beam search.
    """

    def __init__(self, rows: int, vocab_size: int, device: torch.device, max_beam_width: int = 1):
        self.rows, self.vocab_size, self.device = rows, vocab_size, torch.device(device)
        self.max_beam_width = max_beam_width
        self.candidates = min(2 * max_beam_width, vocab_size)
        # every row's state when idle (greedy at position 0, never advancing), copied in by ``release``
        self._idle_ints = torch.zeros(10, rows, dtype=torch.long, device=device)
        self._idle_ints[GREEDY] = self._idle_ints[WIDTH] = 1
        self._idle_ints[PARENT] = torch.arange(rows, device=device)
        self._idle_floats = torch.zeros(4, rows, dtype=torch.float32, device=device)
        self._idle_floats[TEMPERATURE] = self._idle_floats[PENALTY] = 1.0
        self.ints = self._idle_ints.clone()
        self.floats = self._idle_floats.clone()
        self.seen = torch.zeros(rows, vocab_size, dtype=torch.bool, device=device)  # prompt + generated ids
        self.ends = torch.zeros(rows, vocab_size, dtype=torch.bool, device=device)  # a beam leader's end ids
        self.candidate_values = torch.zeros(rows, self.candidates, dtype=torch.float32, device=device)
        self.candidate_ids = torch.zeros(rows, self.candidates, dtype=torch.long, device=device)  # parent·V + id
        self._true = torch.ones((), dtype=torch.bool, device=device)  # a device value: no host copy that waits

    # --- host writes ---------------------------------------------------------------------------------------------

    def set_rows(self, first: int, setups: Sequence[RowSetup]) -> None:
        """Rows ``[first, first + len(setups))`` start a request each (active, their parent themselves)."""
        stop = first + len(setups)
        ints = [[s.token, s.position, 1, int(s.greedy), s.top_k, s.seed & _MASK32, (s.seed >> 32) & _MASK32,
                 s.width, s.offset, first + i] for i, s in enumerate(setups)]
        floats = [[s.temperature if not s.greedy else 1.0, s.top_p, s.repetition_penalty, s.score] for s in setups]
        self.ints[:, first:stop].copy_(host_to_device(ints, torch.long, self.device).T)
        self.floats[:, first:stop].copy_(host_to_device(floats, torch.float32, self.device).T)

    def set_ids(self, table: Tensor, first: int, ids_per_row: Sequence[Sequence[int]]) -> None:
        """``table`` (``seen`` or ``ends``) rows ``[first, first + len(ids_per_row))`` hold exactly these ids."""
        table[first:first + len(ids_per_row)] = False
        pairs = [(first + i, t) for i, ids in enumerate(ids_per_row) for t in set(ids) if 0 <= t < self.vocab_size]
        if pairs:
            index = host_to_device(pairs, torch.long, self.device)
            table.index_put_((index[:, 0], index[:, 1]), self._true)

    def place(self, tokens: Sequence[int], positions: Sequence[int]) -> None:
        """Rows ``[0, len(tokens))`` active, each with its next input token at its position."""
        count = len(tokens)
        self.ints[TOKEN:POSITION + 1, :count] = host_to_device([list(tokens), list(positions)], torch.long,
                                                               self.device)
        self.ints[ACTIVE, :count] = 1

    def snapshot(self) -> tuple[Tensor, Tensor, Tensor]:
        """A copy of the rows' state (for ``restore``)."""
        return self.ints.clone(), self.floats.clone(), self.seen.clone()

    def restore(self, saved: tuple[Tensor, Tensor, Tensor]) -> None:
        for tensor, copy in zip((self.ints, self.floats, self.seen), saved):
            tensor.copy_(copy)

    def release(self, first: int, count: int) -> None:
        """Rows ``[first, first + count)`` idle: greedy at position 0, never advancing."""
        window = slice(first, first + count)
        self.ints[:, window] = self._idle_ints[:, window]
        self.floats[:, window] = self._idle_floats[:, window]

    # --- the device pass -----------------------------------------------------------------------------------------

    def choose(self, logits: Tensor, first: int, full: bool) -> None:
        """Pick the next token of rows ``[first, first + n)`` from their ``logits [n, V]`` and advance them.

        ``full=False`` is for rows that all decode greedily without a penalty (an argmax); ``full=True`` runs
        penalties, sampling and beam search. Each row's token and position are updated in place; a beam row's
        score, parent and seen ids follow its chosen candidate, and a leader's candidates are left in
        ``candidate_values``/``candidate_ids`` for the host.
        """
        n = logits.shape[0]
        window = slice(first, first + n)
        ints, floats = self.ints[:, window], self.floats[:, window]
        ints[POSITION] += ints[ACTIVE]
        if not full:
            ints[TOKEN] = logits.argmax(-1)
            return
        seen = self.seen[window]
        scores = penalize(logits.float(), seen, floats[PENALTY])
        token = torch.where(ints[GREEDY].bool(), scores.argmax(-1), self._sample(scores, ints, floats))
        parent = torch.arange(n, device=logits.device)
        if self.max_beam_width > 1:
            beam_token, beam_parent, beam_score = self._beam(scores, ints, floats, window)
            beam = ints[WIDTH] > 1
            token = torch.where(beam, beam_token, token)
            parent = torch.where(beam, beam_parent, parent)
            floats[SCORE] = torch.where(beam, beam_score, floats[SCORE])
            seen.copy_(seen[parent])
        ints[TOKEN] = token
        ints[PARENT] = parent + first
        seen.scatter_(1, token[:, None], True)

    def _sample(self, scores: Tensor, ints: Tensor, floats: Tensor) -> Tensor:
        """Temperature → top-k → top-p → an exponential race with the row's hashed noise (every row)."""
        vocab = scores.shape[-1]
        ordered, order = (scores / floats[TEMPERATURE, :, None]).sort(dim=-1, descending=True, stable=True)
        top_k = ints[TOP_K, :, None]
        kth = ordered.gather(1, (top_k.clamp(1, vocab) - 1))
        ordered = ordered.masked_fill((top_k > 0) & (ordered < kth), float("-inf"))
        probs = ordered.softmax(-1)
        top_p = floats[TOP_P, :, None]
        mass_before = probs.cumsum(-1) - probs
        probs = probs.masked_fill((top_p > 0) & (top_p < 1) & (mass_before >= top_p), 0.0)
        noise = exponential_noise(ints[SEED_LO], ints[SEED_HI], ints[POSITION], order)
        return order.gather(1, (probs / noise).argmax(-1, keepdim=True))[:, 0]

    def _beam(self, scores: Tensor, ints: Tensor, floats: Tensor, window: slice) -> tuple[Tensor, Tensor, Tensor]:
        """Each beam row's next token, parent (index in the window) and summed log-probability; the leaders'
        best ``2W`` group candidates are stored for the host."""
        n, vocab = scores.shape
        k, widest = self.candidates, self.max_beam_width
        totals = scores.log_softmax(-1) + floats[SCORE, :, None]
        row_values, row_ids = totals.topk(k, dim=-1)  # each row's best k; a group's best 2w are among them
        here = torch.arange(n, device=scores.device)
        member = (here[:, None] + torch.arange(widest, device=scores.device)).clamp(max=n - 1)  # [n, W]
        in_group = torch.arange(widest, device=scores.device) < ints[WIDTH, :, None]
        grouped = row_values[member].masked_fill(~in_group[..., None], float("-inf")).flatten(1)  # [n, W*k]
        values, best = grouped.topk(k, dim=-1)  # sorted, best first
        parent = best // k
        token = row_ids[member].flatten(1).gather(1, best)
        self.candidate_values[window] = values
        self.candidate_ids[window] = parent * vocab + token
        # the device's picks: the first w candidates of the best 2w that neither end the answer nor are impossible
        usable = ((torch.arange(k, device=scores.device) < 2 * ints[WIDTH, :, None]) & (values > float("-inf"))
                  & ~self.ends[window].gather(1, token))
        rank = usable.cumsum(-1)
        leader = here - ints[OFFSET]
        pick = usable[leader] & (rank[leader] == ints[OFFSET, :, None] + 1)  # [n, k]: this row's candidate
        found = pick.any(-1)
        column = pick.to(torch.uint8).argmax(-1, keepdim=True)
        chosen_token = torch.where(found, token[leader].gather(1, column)[:, 0], 0)
        chosen_parent = torch.where(found, leader + parent[leader].gather(1, column)[:, 0], leader)
        chosen_score = torch.where(found, values[leader].gather(1, column)[:, 0], float("-inf"))
        return chosen_token, chosen_parent, chosen_score


def penalize(logits: Tensor, seen: Tensor, penalty: Tensor) -> Tensor:
    """``logits [n, V]`` with each row's seen tokens divided by its ``penalty [n]`` if positive, multiplied if not."""
    factor = penalty[:, None]
    return torch.where(seen, torch.where(logits > 0, logits / factor, logits * factor), logits)


def exponential_noise(seed_lo: Tensor, seed_hi: Tensor, position: Tensor, ids: Tensor) -> Tensor:
    """Exp(1) noise ``[n, V]`` for each row's ``(seed, position)`` and each vocab id in ``ids [n, V]``: the same
    numbers whatever else is computed alongside."""
    row = _mix32(_mix32(_mix32(seed_hi) ^ seed_lo) ^ (position & _MASK32))
    bits = _mix32(row[:, None] ^ ids)
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # in (0, 1)
    return -torch.log(uniform)


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash (xor-shift-multiply rounds) of int64 tensors holding values below 2**32."""
    x = x ^ (x >> 16)
    x = _times32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _times32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _times32(x: Tensor, factor: int) -> Tensor:
    """``x * factor mod 2**32`` in int64 without overflow (16-bit halves of the factor)."""
    low = x * (factor & 0xFFFF)
    high = ((x * (factor >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK32
