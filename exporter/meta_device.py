"""Modules built on the meta device (shapes only) to be given their weights: built without initialising them.

Initialising a parameter on the meta device runs torch's reference implementation of some initialisers
(``nn.init.normal_``, used by ``nn.Embedding``), which imports ``torch._dynamo``: seconds on a cold start, taken
under the import lock, so a second thread building a module waits for the first one's import.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

_INITIALISERS = frozenset(getattr(torch.nn.init, name) for name in (
    "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_", "xavier_uniform_",
    "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_"))


class _SkipInitialisers(TorchFunctionMode):
    """``torch.nn.init``'s in-place initialisers return their tensor untouched; every other call runs."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _INITIALISERS:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Modules built in the block hold meta tensors, left uninitialised (for ``load_state_dict(assign=True)``)."""
    with torch.device("meta"), _SkipInitialisers():
        yield
