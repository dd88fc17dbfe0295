"""How the engine's Triton kernels launch: interpreted or compiled, and as programmatic dependents.

Programmatic dependent launch (PDL, Hopper and later): a kernel launched with `launch_pdl=True` may start while
the kernel before it in the stream is still running, once every program of that one has signalled
(`gdc_launch_dependents`, here at its start). Its programs then wait (`gdc_wait`) for that kernel to finish and
its writes to be visible before they read anything another kernel wrote, or write anything. The launch, the
programs' start and any read of constant data (the weights) before the wait overlap the previous kernel's last
programs. A decode step is ~280 short kernels in a row, so this is time a step saves at every kernel boundary.

The rule that keeps it safe: a kernel launched as a dependent waits before any other memory access, and a kernel
that does not wait is never launched as one. Each kernel here takes a `PDL` constexpr and is launched with
`launch_pdl=PDL`, both from `dependent_launch(device)`. Reads before the wait are of weights only: those are
never written while a step runs. A kernel that is not a dependent (torch's, cuBLAS's) waits for the whole
previous kernel as always, and one after it starts when it ends.
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: nothing launches here
    triton = None

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's interpreter (CPU checks): no PTX, no PDL
# On by default where the GPU has them (a batch-1 step 5-7% faster on the H200, docs/performance.md); "0" turns
# dependent launches off.
ENVIRONMENT = "NEMO_MM_DEPENDENT_LAUNCH"
_override: bool | None = None


def dependent_launch(device: torch.device) -> bool:
    """Whether the kernels launched on ``device`` launch as programmatic dependents: CUDA of compute capability 9
    or later, a Triton that has them (`supported`), not turned off (`ENVIRONMENT`, `set_dependent_launch`). Under the
    interpreter, only where `set_dependent_launch(True)` asks: the kernels then run their code for it, without the
    grid controls (the CPU checks of that code)."""
    if triton is None:
        return False
    if INTERPRETED:
        return bool(_override)
    if device.type != "cuda":
        return False
    wanted = _override if _override is not None else os.environ.get(ENVIRONMENT, "1") != "0"
    return wanted and supported(device)


def supported(device: torch.device) -> bool:
    """Whether ``device`` can launch the kernels as programmatic dependents (CUDA of compute capability 9 or
    later, a compiled Triton that has the grid controls)."""
    if device.type != "cuda" or INTERPRETED or triton is None:
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


def set_dependent_launch(on: bool | None) -> None:
    """Turn dependent launches on or off for the kernels launched from now on (None: back to `ENVIRONMENT`). A
    step graph keeps the launches it was captured with."""
    global _override
    _override = on


@functools.cache
def _supported(device_index: int) -> bool:
    return (torch.cuda.get_device_capability(device_index)[0] >= 9
            and hasattr(getattr(getattr(tl, "extra", None), "cuda", None), "gdc_wait"))


if triton is not None:
    _GRID_CONTROL = tl.constexpr(not INTERPRETED)  # the interpreter has no grid dependency controls

    @triton.jit
    def start_dependents(PDL: tl.constexpr):
        """Let the next kernel (a dependent) start now: call at a program's start, with `PDL` as launched."""
        if PDL and _GRID_CONTROL:
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def wait_for_producers(PDL: tl.constexpr):
        """Wait for the kernel before this one to finish, its writes visible (launched as a dependent): before any
        memory access but reads of weights."""
        if PDL and _GRID_CONTROL:
            tl.extra.cuda.gdc_wait()
