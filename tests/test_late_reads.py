"""`bench/late_reads.py`'s recorder: the start of the LLM weights' stream and the late reads, for a repository
given as deploy_triton.py's users give it (here a relative path, opened relative to the working folder)."""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def late_reads(monkeypatch):
    """bench/late_reads.py as a module, its audit hook handed to the test (a real one cannot be removed)."""
    spec = importlib.util.spec_from_file_location("late_reads_under_test", REPO / "bench" / "late_reads.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    hooks: list = []
    monkeypatch.setattr(sys, "addaudithook", hooks.append)
    module.hooks = hooks
    return module


def test_a_relative_repository_s_stream_and_late_reads_are_seen(late_reads, tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    for name in ("engine/llm_engine/model.safetensors", "engine/visual_engine/model.safetensors"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x" * 100)
    import deploy_triton

    def serve(arguments: list[str]) -> int:  # deploy_triton.main: the stream's first read, a late read, READY
        (hook,) = late_reads.hooks
        stream = threading.Thread(target=hook, name="engine-prefetch",
                                  args=("open", ("engine/llm_engine/model.safetensors", "rb", 0)))
        stream.start()
        stream.join()
        hook("open", ("engine/visual_engine/model.safetensors", "rb", 0))
        logging.getLogger("deploy_triton").info("READY 1.00 s after the process started")
        return 0

    monkeypatch.setattr(deploy_triton, "main", serve)
    logger = logging.getLogger("deploy_triton")
    handlers = list(logger.handlers)
    try:
        with caplog.at_level(logging.INFO, logger="deploy_triton"):
            assert late_reads.run(["-tmn", "m", "-tmr", "engine"], tmp_path / "late.json", stop_at_ready=False) == 0
    finally:
        for handler in set(logger.handlers) - set(handlers):
            logger.removeHandler(handler)
    report = json.loads((tmp_path / "late.json").read_text())
    assert report["stream_began_s"] is not None
    assert report["late_files_by_kind"] == {"engine": {"files": 1, "bytes": 100}}
