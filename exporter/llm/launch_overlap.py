"""Programmatic dependent launch: a decode step's Triton kernels each start while the kernel before them ends.

A batch-1 decode step is some three hundred short kernels, and each one's launch and first memory requests cost
time the kernel before it could hide. On Hopper and later GPUs a kernel can be launched as a programmatic
dependent (`launch_pdl`): its programs are placed on the GPU once every program of the kernel before it has let
them (`gdc_launch_dependents`), and `gdc_wait` holds them until that kernel has finished and its writes are
visible. Every kernel that takes part calls `wait_for_previous` first, which does both before it reads or writes
anything, so the order of the kernels' memory work is still the stream's order; only the launches overlap. A
kernel that does not take part (cuBLAS, torch's own) is launched as before and waits as before.

`launch_options(device)` gives a launch's keyword arguments: the kernel's `PDL` flag and Triton's `launch_pdl`
together (never one without the other), on CUDA devices of compute capability 9.0 or later with a Triton that
has grid dependency control, unless `NEMO_MM_LAUNCH_OVERLAP=0`; elsewhere (the CPU, Triton's interpreter, older
GPUs) `PDL=False` alone, and the kernels run as they always did. `bench/launch_overlap_probe.py` measures the gain
on a chain of products; captured in CUDA graphs too.
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: no kernel launches through here
    triton = None

ENV = "NEMO_MM_LAUNCH_OVERLAP"  # "0" launches every kernel plainly


def supported() -> bool:
    """Whether this Triton has grid dependency control and programmatic launches, outside its interpreter."""
    if triton is None or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    cuda = getattr(tl.extra, "cuda", None)
    return hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")


@functools.cache
def _device_overlaps(index: int) -> bool:
    return supported() and torch.cuda.get_device_capability(index) >= (9, 0)


def launch_options(device: torch.device) -> dict[str, bool]:
    """The keyword arguments that launch a taking-part kernel on `device`: `PDL` (its flag) and, where it is True,
    Triton's `launch_pdl`."""
    if device.type != "cuda" or os.environ.get(ENV, "1") == "0":
        return {"PDL": False}
    index = device.index if device.index is not None else torch.cuda.current_device()
    return {"PDL": True, "launch_pdl": True} if _device_overlaps(index) else {"PDL": False}


if triton is not None:

    @triton.jit
    def wait_for_previous(PDL: tl.constexpr):
        """With `PDL`: let the next kernel be launched, then wait until the previous kernel has finished and its
        writes are visible. Call it before the kernel reads or writes memory."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
