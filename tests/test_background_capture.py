"""Step graphs at start-up: a first request's captured before READY, the others by the scheduler's thread while it
is idle; a step whose graph is not captured yet runs the same computation eagerly.

CUDA graphs cannot run here (and the graphs' static chunk layout is read by the CUDA kernels only): `capture` is
replaced by a stand-in that records which graph was captured, on which thread and whether a request was admitted
then, and the static buffers live on the CPU. The scheduler, its thread and the eager fallback are the real code;
answers are compared with the eager scheduler's.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

import pytest
import torch

from exporter.llm import gemv
from exporter.llm.generate import SamplingParams
from exporter.llm.model import Decoder
from exporter.runtime import cuda_graphs
from exporter.runtime.scheduler import Scheduler, generate
from support.decoders import SCHEDULER_VOCAB, scheduler_decoder


class _Captures(list):
    """Per capture, its thread's name and whether a request was admitted or waiting then; the schedulers watched."""

    def __init__(self):
        super().__init__()
        self.schedulers: list[Scheduler] = []
        self.times: list[float] = []


class _Graph:
    def replay(self) -> None:
        raise AssertionError("no step replays a stand-in graph here")


@pytest.fixture(scope="module")
def model() -> Decoder:
    return scheduler_decoder()


@pytest.fixture
def captures(monkeypatch) -> _Captures:
    """Graphs "captured" on the CPU, recorded."""
    records = _Captures()

    def capture(fn, pool, proceed=None, seconds=None):
        busy = any(scheduler.waiting or any(scheduler.slots) for scheduler in records.schedulers)
        records.append((threading.current_thread().name, busy))
        records.times.append(time.monotonic())
        return _Graph(), None

    monkeypatch.setattr(cuda_graphs, "capture", capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    return records


def _graphed_scheduler(model: Decoder, captures: _Captures) -> Scheduler:
    scheduler = Scheduler(model, max_slots=4, max_seq_len=64, eos_id=None, max_num_tokens=64)
    scheduler.forward.enabled = True
    scheduler.forward.allocate_static_inputs()
    captures.schedulers.append(scheduler)
    return scheduler


REQUESTS = [
    (1, 5, SamplingParams(max_output_len=9)),
    (2, 21, SamplingParams(max_output_len=6, repetition_penalty=1.3)),
    (3, 40, SamplingParams(max_output_len=8, top_k=0, top_p=0.9, temperature=0.8, seed=11)),
]


def _prompts(model: Decoder) -> list[tuple[torch.Tensor, list[int], SamplingParams]]:
    prompts = []
    for seed, length, params in REQUESTS:
        ids = torch.randint(3, SCHEDULER_VOCAB, (length,), generator=torch.Generator().manual_seed(seed))
        prompts.append((model.embed(ids), ids.tolist(), params))
    return prompts


def test_served_steps_without_their_graph_run_eagerly_and_capture_nothing(model, captures):
    expected = [generate(model, [embeds], [ids], [params], eos_id=None)[0][0]
                for embeds, ids, params in _prompts(model)]
    scheduler = _graphed_scheduler(model, captures)  # graphs on, none captured: no warm-up
    scheduler.forward.capture_on_demand = False  # as a server's warm_up(rest_in_background=True) sets it
    scheduler.start()
    try:
        handles = [scheduler.submit(*prompt) for prompt in _prompts(model)]
        assert [handle.result(timeout=60) for handle in handles] == expected
    finally:
        scheduler.stop()
    assert scheduler.forward.eager_steps > 0 and captures == []  # no request waited for a capture


def test_first_request_graphs_before_ready_the_rest_when_idle(model, captures):
    scheduler = _graphed_scheduler(model, captures)
    forward = scheduler.forward
    done = threading.Event()
    scheduler.on_captured = done.set
    scheduler.warm_up(rest_in_background=True)
    first, every = forward.first_keys(), forward.graph_keys()
    assert sorted(forward.graphs) == sorted(first) and 0 < len(first) < len(every)
    assert {rows for rows, *_ in first} == {0, 1} and {padded for _, padded, *_ in first} > {0}
    assert every[len(first):len(first) + 2] == [(4, 0, False, False), (4, 0, True, False)]  # all rows next
    assert scheduler.capture_stats["before"] == len(first)
    assert scheduler.capture_stats["left"] == len(every) - len(first)
    assert captures == [("MainThread", False)] * len(first)
    scheduler.capture_after_idle_s = scheduler.capture_after_ready_s = 0.2
    scheduler.start()
    try:
        time.sleep(1.0)
        assert len(captures) == len(first)  # not before the server is READY, however long it idles
        scheduler.capture_in_background()
        assert done.wait(60), "the background captures did not finish"
    finally:
        scheduler.stop()
    assert sorted(forward.graphs) == sorted(every)
    assert captures[len(first):] == [("scheduler", False)] * (len(every) - len(first))
    assert scheduler.capture_stats["after"] == len(every) - len(first)


def test_background_captures_wait_for_the_requests(model, captures, monkeypatch):
    scheduler = _graphed_scheduler(model, captures)
    scheduler.warm_up(rest_in_background=True)
    monkeypatch.setattr(cuda_graphs.ForwardStep, "_graph_key", lambda *args: None)  # every step eager here
    handles = [scheduler.submit(*prompt) for prompt in _prompts(model)]  # before the thread starts
    done = threading.Event()
    scheduler.on_captured = done.set
    scheduler.capture_after_idle_s = 0.5
    scheduler.capture_in_background()
    scheduler.start()
    try:
        for handle in handles:
            handle.result(timeout=60)
        answered = time.monotonic()
        assert done.wait(60)
    finally:
        scheduler.stop()
    assert all(not busy for _, busy in captures)  # no capture while a request was admitted or waiting
    background = captures.times[len(scheduler.forward.first_keys()):]
    assert background and min(background) >= answered  # none between the requests
    assert min(background) - answered >= 0.5 / 2  # nor right after (the next may come)
    assert scheduler.decode_steps > 0


def test_warm_up_captures_everything_by_default(model, captures):
    scheduler = _graphed_scheduler(model, captures)
    scheduler.warm_up()
    assert sorted(scheduler.forward.graphs) == sorted(scheduler.forward.graph_keys())
    assert scheduler.capture_stats["left"] == 0 and not scheduler._capture_later


def test_the_kernel_timing_buffer_is_released_once_the_last_graph_is_captured(model, captures, monkeypatch):
    """`gemv.measure_ms` keeps its L2-evicting buffer only on CUDA: a stand-in entry here shows when the scheduler
    drops it, after the background captures (which may time kernels of new shapes), not after the warm-up that
    left some; a warm-up capturing everything drops it at once."""
    monkeypatch.setattr(gemv, "_EVICT", {0: torch.zeros(4)})
    scheduler = _graphed_scheduler(model, captures)
    done = threading.Event()
    scheduler.on_captured = done.set
    scheduler.warm_up(rest_in_background=True)
    assert scheduler.capture_stats["left"] > 0 and list(gemv._EVICT) == [0]
    scheduler.capture_after_idle_s = scheduler.capture_after_ready_s = 0.05
    scheduler.start()
    try:
        scheduler.capture_in_background()
        assert done.wait(60), "the background captures did not finish"
    finally:
        scheduler.stop()
    assert gemv._EVICT == {}
    gemv._EVICT[0] = torch.zeros(4)
    _graphed_scheduler(model, captures).warm_up()
    assert gemv._EVICT == {}


def _ready_and_eager(scheduler: Scheduler, monkeypatch, capture) -> None:
    """Captures by ``capture``, every step eager, the server READY at once (a short idle time), the thread started."""
    monkeypatch.setattr(cuda_graphs, "capture", capture)
    monkeypatch.setattr(cuda_graphs.ForwardStep, "_graph_key", lambda *args: None)
    scheduler.capture_after_idle_s = scheduler.capture_after_ready_s = 0.05
    scheduler.capture_in_background()
    scheduler.start()


def _wait_until(condition: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_failing_background_capture_leaves_the_steps_eager(model, captures, monkeypatch):
    scheduler = _graphed_scheduler(model, captures)
    scheduler.warm_up(rest_in_background=True)
    _ready_and_eager(scheduler, monkeypatch, capture=lambda fn, pool, proceed, seconds: 1 / 0)
    try:
        _wait_until(lambda: not scheduler._capture_later)  # gave up after the failure
        embeds, ids, params = _prompts(model)[0]
        expected = generate(model, [embeds], [ids], [params], eos_id=None)[0][0]
        assert scheduler.submit(embeds, ids, params).result(timeout=60) == expected
    finally:
        scheduler.stop()


def test_no_background_capture_until_a_request_after_ready(model, captures, monkeypatch):
    """READY and idle: the background captures wait for a first request (likely soon after READY) or a long idle
    time; once a request is answered, the usual short idle time."""
    scheduler = _graphed_scheduler(model, captures)
    scheduler.warm_up(rest_in_background=True)
    monkeypatch.setattr(cuda_graphs.ForwardStep, "_graph_key", lambda *args: None)  # every step eager here
    before = len(captures)
    done = threading.Event()
    scheduler.on_captured = done.set
    scheduler.capture_after_idle_s, scheduler.capture_after_ready_s = 0.05, 600.0
    scheduler.capture_in_background()
    scheduler.start()
    try:
        time.sleep(1.0)
        assert len(captures) == before  # READY, idle 20 times the short idle time: no capture yet
        embeds, ids, params = _prompts(model)[0]
        scheduler.submit(embeds, ids, params).result(timeout=60)
        answered = time.monotonic()
        assert done.wait(60), "the background captures did not follow the request"
    finally:
        scheduler.stop()
    assert min(captures.times[before:]) >= answered
    assert scheduler.forward.uncaptured() == 0


def test_a_request_during_a_background_capture_puts_it_off(model, captures, monkeypatch):
    """A capture under way when a request comes (5 s here, in slices of 0.25 s) stops at its next slice: the
    request is admitted at once instead of after the capture, which is taken up again at the next idle time."""
    scheduler = _graphed_scheduler(model, captures)
    scheduler.warm_up(rest_in_background=True)
    recorded, starts, slow = cuda_graphs.capture, [], threading.Event()
    slow.set()
    done = threading.Event()
    scheduler.on_captured = done.set

    def slow_capture(fn, pool, proceed, seconds):  # a capture that compiles and times kernels: long against a step
        starts.append(time.monotonic())
        for _ in range(20 if slow.is_set() else 0):
            if not proceed():
                return None
            time.sleep(0.25)
        return recorded(fn, pool, proceed)

    _ready_and_eager(scheduler, monkeypatch, capture=slow_capture)
    try:
        _wait_until(lambda: starts)  # a background capture started
        put_off = next(key for key in scheduler.forward.graph_keys() if key not in scheduler.forward.graphs)
        embeds, ids, params = _prompts(model)[0]
        submitted = time.monotonic()
        handle = scheduler.submit(embeds, ids, params)
        handle.result(timeout=60)
        answered = time.monotonic()
        assert put_off not in scheduler.forward.graphs and scheduler.capture_stats["put_off"] == 1
        slow.clear()
        assert done.wait(60), "the background captures did not finish"
    finally:
        scheduler.stop()
    assert handle.admitted_at - submitted < 2.5  # a slice and a loaded machine's slack, not the 5 s capture
    assert [t for t in starts if submitted < t < answered] == []  # no capture began while the request ran
    assert put_off in scheduler.forward.graphs and scheduler.forward.uncaptured() == 0


def test_a_step_whose_graph_is_not_captured_yet_runs_a_bigger_captured_bucket(model, captures, monkeypatch):
    """Decode steps of 2 rows replay the 4-row graph, the first captured in the background (its extra rows idle); prompt
    chunks run eagerly here (their static layout is read by the CUDA kernels only)."""
    compute, key_of = cuda_graphs.ForwardStep._compute, cuda_graphs.ForwardStep._graph_key

    class Replayed:
        def __init__(self, fn):
            self.fn, self.output = fn, fn()

        def replay(self):
            self.output.copy_(self.fn())

    def capture(fn, pool, proceed=None, seconds=None):
        graph = Replayed(fn)
        return graph, graph.output

    def full_span(self, rows, chunk, full, span, lora=False):  # the CPU attention gathers every key a row has
        return compute(self, rows, chunk, full, span or self.tables.shape[1] * self.cache.block_size, lora)

    monkeypatch.setattr(cuda_graphs, "capture", capture)
    monkeypatch.setattr(cuda_graphs.ForwardStep, "_compute", full_span)
    monkeypatch.setattr(cuda_graphs.ForwardStep, "_graph_key",
                        lambda self, rows, pieces, *rest: None if pieces else key_of(self, rows, pieces, *rest))
    prompts = [(embeds, ids, SamplingParams(max_output_len=length))  # the last row ends first: 2 rows decode
               for (embeds, ids, _), length in zip(_prompts(model), (9, 7, 3))]
    expected = [generate(model, [embeds], [ids], [params], eos_id=None)[0][0] for embeds, ids, params in prompts]
    scheduler = _graphed_scheduler(model, captures)
    scheduler.warm_up(rest_in_background=True)
    assert scheduler.forward.capture_next() and scheduler.forward.capture_next()  # the first background ones
    assert (4, 0, False, False) in scheduler.forward.graphs and (2, 0, False, False) not in scheduler.forward.graphs
    handles = [scheduler.submit(*prompt) for prompt in prompts]
    scheduler.start()
    try:
        assert [handle.result(timeout=60) for handle in handles] == expected
    finally:
        scheduler.stop()
    assert scheduler.forward.padded_steps > 0 and scheduler.forward.eager_steps == 0
    assert (2, 0, False, False) not in scheduler.forward.graphs  # nothing captured for it: not READY yet


def test_capture_stops_between_its_slices_when_told(monkeypatch):
    """`capture`'s slices (one warm-up run on a side stream, two where the first timed kernels, then the capture):
    ``proceed`` is asked before each, and a stop leaves the device's streams joined and nothing captured. CUDA
    stand-ins record the calls."""
    calls = []

    class Stream:
        def wait_stream(self, other):
            calls.append("join")

    class Graph:
        pass

    @contextlib.contextmanager
    def on(stream_or_graph, **kwargs):
        calls.append("capture" if isinstance(stream_or_graph, Graph) else "side")
        yield

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", on)
    timed = [0]  # kernels timed so far: a warm-up run that times some is run again (once)
    monkeypatch.setattr(cuda_graphs, "timings", lambda: timed[0])
    for choosing, warm_ups in ((False, 1), (True, cuda_graphs.MAX_WARM_UP_RUNS)):
        def run():
            calls.append("run")
            timed[0] += choosing  # a run that chooses kernels times them

        for allowed in range(warm_ups + 2):
            calls.clear()
            answers = iter([True] * allowed + [False] * 3)
            result = cuda_graphs.capture(run, None, lambda: next(answers))
            runs = min(allowed, warm_ups)
            assert calls[:1 + 2 * runs] == ["join"] + ["side", "run"] * runs
            if allowed <= warm_ups:
                assert result is None and calls[1 + 2 * runs:] == ["join"]
            else:
                assert isinstance(result[0], Graph) and calls[1 + 2 * runs:] == ["join", "capture", "run"]
