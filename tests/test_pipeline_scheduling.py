"""Every request of the pipeline goes to its one in-flight scheduler: greedy, sampled and beam-search requests, from
one call or from concurrent callers, each answered as it is alone; `max_beam_width` (an export option, recorded in
the engine) caps num_beams before any work is done."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from exporter import TensorRTMMExporter
from exporter.engine import EngineLimits, LimitError
from exporter.llm.generate import SamplingParams
from exporter.runtime import Request
from support.demo import DEMO_IMAGES, DEMO_NEMO

REPO = Path(__file__).resolve().parent.parent
QUESTION = "What shape is this?"


@pytest.fixture(scope="module")
def exporter(tmp_path_factory) -> TensorRTMMExporter:
    exporter = TensorRTMMExporter(tmp_path_factory.mktemp("engine"), device="cpu")
    exporter.export(DEMO_NEMO, model_type="neva", dtype="float32", max_batch_size=6, max_input_len=200,
                    max_output_len=12, max_multimodal_len=6 * 64, max_beam_width=3)
    yield exporter
    exporter.pipeline.close()


def _requests() -> list[Request]:
    image = str(DEMO_IMAGES / "red_circle.png")
    return [
        Request(QUESTION, image, SamplingParams(max_output_len=6)),
        Request(QUESTION, image, SamplingParams(max_output_len=6, num_beams=3)),
        Request("What color is the shape?", str(DEMO_IMAGES / "blue_triangle.png"),
                SamplingParams(max_output_len=8, top_k=0, top_p=0.95, temperature=1.5, seed=7)),
        Request(QUESTION, image, SamplingParams(max_output_len=5, num_beams=2, repetition_penalty=1.5)),
        Request(QUESTION, image, SamplingParams(max_output_len=7, top_k=3, temperature=2.0, seed=1,
                                                repetition_penalty=1.2)),
    ]


def test_mixed_requests_in_one_call_and_from_concurrent_callers_get_their_answers_alone(exporter):
    requests = _requests()
    alone = [exporter.generate([request])[0] for request in requests]
    assert [len(completion.token_ids) for completion in alone] == [1, 3, 1, 2, 1]
    together = exporter.generate(requests)
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    assert [c.texts for c in together] == [c.texts for c in alone]

    concurrent: dict[int, list[list[int]]] = {}

    def caller(k: int) -> None:
        concurrent[k] = exporter.generate([requests[k]])[0].token_ids

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert [concurrent[k] for k in range(len(requests))] == [c.token_ids for c in alone]


def test_num_beams_over_max_beam_width_is_refused_at_once_with_flat_memory(exporter):
    process = psutil.Process()
    image = str(DEMO_IMAGES / "red_circle.png")
    exporter.generate([Request(QUESTION, image, SamplingParams(max_output_len=2))])  # warm
    rss = process.memory_info().rss
    start = time.perf_counter()
    huge, fine = exporter.generate([Request(QUESTION, image, SamplingParams(max_output_len=12, num_beams=4000)),
                                    Request(QUESTION, image, SamplingParams(max_output_len=2))])
    elapsed = time.perf_counter() - start
    assert isinstance(huge, LimitError)
    assert str(huge) == ("num_beams=4000 is over the engine's max_beam_width=3; ask for fewer beams or export with "
                         "a larger max_beam_width")
    assert elapsed < 0.5 and process.memory_info().rss - rss < 16 * 2**20
    assert fine.texts and not isinstance(fine, Exception)
    with pytest.raises(LimitError, match="max_beam_width=3"):
        exporter.forward(QUESTION, image, num_beams=4)


def test_max_beam_width_is_recorded_and_older_engines_load_with_one(exporter, tmp_path):
    manifest = json.loads((exporter.model_dir / "manifest.json").read_text())
    assert manifest["limits"]["max_beam_width"] == 3
    del manifest["limits"]["max_beam_width"]  # as engines exported before the option were written
    older = tmp_path / "older"
    older.mkdir()
    for item in exporter.model_dir.iterdir():
        (older / item.name).symlink_to(item)
    (older / "manifest.json").unlink()
    (older / "manifest.json").write_text(json.dumps(manifest))
    loaded = TensorRTMMExporter(older, device="cpu")
    try:
        assert loaded.engine.limits.max_beam_width == 1
        with pytest.raises(LimitError, match="num_beams=2 is over the engine's max_beam_width=1"):
            loaded.forward(QUESTION, str(DEMO_IMAGES / "red_circle.png"), num_beams=2)
    finally:
        loaded.pipeline.close()


def test_max_beam_width_over_max_batch_size_is_refused_at_export(tmp_path):
    with pytest.raises(LimitError, match="max_beam_width=4 is over max_batch_size=2: each beam takes one"):
        EngineLimits(max_batch_size=2, max_beam_width=4)
    with pytest.raises(LimitError, match="max_beam_width must be at least 1"):
        TensorRTMMExporter(tmp_path, device="cpu").export(DEMO_NEMO, model_type="neva", max_beam_width=0)


def test_deploy_script_passes_max_beam_width_to_the_export():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import deploy_triton
    finally:
        sys.path.pop(0)
    settings = deploy_triton.parse_settings(["-tmn", "m", "--max_beam_width", "4"])
    assert deploy_triton._export_arguments(settings)["max_beam_width"] == 4
    assert deploy_triton.parse_settings(["-tmn", "m"]).max_beam_width == 1
