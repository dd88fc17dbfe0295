"""Read a NeMo checkpoint (`.nemo` tar, gzip tar or folder) into canonical weights (docs/architecture.md).

Nothing is extracted to disk and the weights are never held twice: every tensor is allocated once at its final
(merged, un-stacked) size and the stored bytes of each shard or chunk are streamed into place.

Modules by job: `archive` (tar/folder access, unsafe members refused), `names` (canonical weight names),
`reader` (`NemoCheckpoint`: layout detection, config, artifacts), `legacy` (`model_weights.ckpt` and TP/PP
shards), `torch_dist` (dist checkpoints), `nemo2` (NeMo 2.0 config mapping), `streaming` (bytes into tensors),
`experts` (per-expert weights read into one stacked tensor). `NemoCheckpoint.tensor_stream` hands the tensors
out one at a time in stored order instead, for a writer that streams them on.
"""

from .archive import NemoCheckpointError
from .names import (
    FC1_UP,
    GATED_ACTIVATIONS,
    LAYER_KEY,
    LEGACY_LAYER_NAMES,
    SEPARATE_UP_ACTIVATIONS,
    TE_NORM_NAMES,
    canonical_name,
    holds_gate_and_up,
    swap_prefix,
    tp_split_dim,
)
from .nemo2 import NEMO2_RENAMED_FIELDS, nemo2_to_nemo1_config
from .reader import NemoCheckpoint
from .streaming import TensorStream

__all__ = [
    "FC1_UP", "GATED_ACTIVATIONS", "LAYER_KEY", "LEGACY_LAYER_NAMES", "NEMO2_RENAMED_FIELDS",
    "SEPARATE_UP_ACTIVATIONS", "TE_NORM_NAMES", "NemoCheckpoint", "NemoCheckpointError", "TensorStream",
    "canonical_name", "holds_gate_and_up", "nemo2_to_nemo1_config", "swap_prefix", "tp_split_dim",
]
