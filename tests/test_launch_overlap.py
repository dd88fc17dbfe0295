"""Programmatic dependent launch (`exporter.llm.launch_overlap`): which launches take part, and that the kernels'
`PDL` flag and Triton's `launch_pdl` always come together. The kernels' sm_90 builds with it are checked where
they are compiled (tests/test_fused_kernels.py, tests/test_quant_kernels.py); on a GPU every kernel test runs
with it on."""

from __future__ import annotations

import pytest
import torch

from exporter.llm import launch_overlap


def test_the_cpu_launches_plainly():
    assert launch_overlap.launch_options(torch.device("cpu")) == {"PDL": False}


def test_the_environment_turns_it_off_before_any_device_is_asked(monkeypatch):
    monkeypatch.setenv(launch_overlap.ENV, "0")
    monkeypatch.setattr(launch_overlap, "_device_overlaps", lambda index: pytest.fail("the device was asked"))
    assert launch_overlap.launch_options(torch.device("cuda", 0)) == {"PDL": False}


@pytest.mark.parametrize("overlaps", [True, False])
def test_the_flag_and_the_launch_option_come_together(monkeypatch, overlaps):
    monkeypatch.delenv(launch_overlap.ENV, raising=False)
    monkeypatch.setattr(launch_overlap, "_device_overlaps", lambda index: overlaps)
    options = launch_overlap.launch_options(torch.device("cuda", 0))
    assert options == ({"PDL": True, "launch_pdl": True} if overlaps else {"PDL": False})


def test_the_interpreter_does_not_take_part(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not launch_overlap.supported()
