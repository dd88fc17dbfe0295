"""The engine directory: ``export`` writes it from a ``.nemo``, ``load`` serves from it alone.

Layout (docs/engine_format.md)::

    model_dir/manifest.json           format version, model type, modality, dtype, limits, source, package version
    model_dir/visual_engine/          (or perception_engine/) config.json + model.safetensors [+ encoder.onnx]
    model_dir/llm_engine/             config.json, model.safetensors (tensor parallel: model.rank<r>.safetensors,
                                      one per rank), tokenizer files, template.json
    model_dir/llm_engine/lora/<uid>/  LoRA adapters served per request (adapter.safetensors, adapter.json)
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol

import torch

from ..checkpoint import NemoCheckpoint, TensorStream
from ..llm.config import DecoderConfig
from ..llm.lora_layers import LoraBank, check_lora_adapter
from ..llm.model import Decoder, select_llm_weights
from ..llm.quant.convert import ExportQuantization
from ..llm.quant.kernels import remake_copies
from ..llm.tensor_parallel import EMBEDDING, Shard, adopt_nemo_shard, check_tensor_parallel, split_weights
from ..llm.tokenizer import Tokenizer, load_saved_tokenizer
from ..lora import (
    LORA_DIR,
    LoraAdapter,
    LoraPlan,
    load_adapters,
    merge_adapter,
    merge_extra,
    merge_lora,
    plan_lora,
    save_adapters,
)
from ..lora.adapters import LORA_MARKER
from ..media_safety import MediaPolicy
from ..models import Perception, get_model_type
from ..models.templates import ChatTemplate
from .atomic import install, previous_engine, staging_folder
from .errors import EngineError
from .integrity import AGAIN, MANIFEST, HashCheck, check_files, describe_files, mark_verified, sha256_file
from .limits import EngineLimits
from .loading import LoadStats, PendingWeights, load_tensors
from .progress import byte_progress, phase, timeline
from .writing import stream_tensors, write_tensors

FORMAT_VERSION = 2
LLM_DIR = "llm_engine"
LLM_WEIGHTS = f"{LLM_DIR}/model.safetensors"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# the devices whose LLM weights `load_engine(weights_in_background=True)` fills beside the warm-up (on the CPU the
# file is mapped: nothing to wait for)
BACKGROUND_DEVICE_TYPES = ("cuda",)


def llm_weights_file(shard: Shard) -> str:
    """The engine file (relative to the engine directory) of a rank's LLM weights."""
    return LLM_WEIGHTS if shard.size == 1 else f"{LLM_DIR}/model.rank{shard.rank}.safetensors"


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` → ``torch.bfloat16``; an unknown name is an error listing the supported ones."""
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; supported: {', '.join(DTYPES)}")
    return DTYPES[name]


class BesideLlmWrite(Protocol):
    """Work an export runs beside its LLM weights' write, from their layout (`export_engine`'s ``beside``: the
    kernel warm-up of `exporter.runtime.kernel_warmup`). Its errors are its own: none of these raises."""

    def start(self, config: DecoderConfig, layout: dict[str, torch.Tensor]) -> None:
        """Start, once the LLM's config and its weights file's layout (meta tensors: names, shapes and the dtypes
        written) are known, before the file is written (a tensor-parallel export does not call it)."""

    def written(self) -> None:
        """The LLM weights' file is written."""

    def wait(self) -> None:
        """Return once the work is over, whether the export goes on or failed."""

    def installed(self) -> None:
        """The engine is installed in its folder (not called when the export failed)."""


def export_engine(model_dir: str | Path, visual_checkpoint_path: str | Path, *,
                  delete_existing_files: bool = True, beside: BesideLlmWrite | None = None,
                  **options: Any) -> dict[str, Any]:
    """Read the checkpoint(s), build perception and LLM, write the engine directory; return the manifest.

    Atomic (`exporter.engine.atomic`): the engine is built and validated beside the previous one, which it then
    replaces; a failure leaves `model_dir` as it was. ``beside``: work started beside the LLM weights' write,
    waited for before the engine is installed (or the export fails). `options` are `_write_engine`'s.
    """
    model_dir = Path(model_dir)
    previous = previous_engine(model_dir, delete_existing_files)
    with staging_folder(model_dir) as staging, timeline("the export"):
        try:
            manifest = _write_engine(staging, visual_checkpoint_path, beside=beside, **options)
            check_files(staging, manifest, verify=False)  # every file listed, of its size, safetensors readable
            mark_verified(staging, manifest["files"])  # the hashes were just taken from these files
        finally:
            if beside is not None:
                beside.wait()
        install(staging, model_dir, previous)
        if beside is not None:
            beside.installed()
    return manifest


def _write_engine(model_dir: Path, visual_checkpoint_path: str | Path, *, model_type: str = "neva",
                  llm_checkpoint_path: str | Path | None = None, llm_model_type: str = "llama",
                  limits: EngineLimits | None = None, dtype: str = "bfloat16",
                  vision_tower_path: str | None = None, tokenizer_path: str | None = None,
                  export_onnx: bool = False, rename_keys: tuple[str, ...] = (),
                  audio_frontend: str | None = None, video_frame_sampling: str | None = None,
                  quantization: str | None = None, calib_data: str | Path | None = None,
                  device: str = "cpu", lora: LoraPlan | None = None,
                  merged_lora: LoraAdapter | None = None, tensor_parallel_size: int = 1,
                  beside: BesideLlmWrite | None = None) -> dict[str, Any]:
    """Write a new engine into the empty folder `model_dir`; return its manifest.

    ``quantization`` (``int8_wo``, ``int4_wo``, ``int4_awq``, ``fp8``) stores the LLM layers' weights quantized,
    computed on ``device``; ``calib_data``: int4_awq's calibration prompts (a text file, one per line). ``lora``:
    the LoRA adapters served per request (stored in the engine); ``merged_lora``: one adapter merged into the
    weights instead (its checkpoint's other fine-tuned tensors, a projector say, replace the base's).
    Once the checkpoint is read, its sha256 is taken on a thread of its own (from the page cache, mostly) while the
    perception and the LLM weights are written. ``tensor_parallel_size``: the LLM is written as that many rank
    files (`exporter.llm.tensor_parallel`); a checkpoint sharded at that size (mp_rank_XX/ files, the LLM inside
    it) is read rank by rank, never merged; any other is merged, then split one tensor at a time. ``beside``
    (`BesideLlmWrite`) starts once the LLM's layout is known, before its weights are written."""
    kind = get_model_type(model_type)
    if tensor_parallel_size > 1 and (quantization is not None or lora is not None):
        raise EngineError("tensor_parallel_size > 1 serves neither quantized weights nor LoRA adapters; export "
                          "with tensor_parallel_size 1 for them")
    quantizer = None if quantization is None and calib_data is None else \
        ExportQuantization.from_options(quantization, calib_data, device)
    target = torch_dtype(dtype)
    limits = limits or EngineLimits()
    if limits.vision_max_batch_size is None:  # the manifest records the model type's default
        limits = replace(limits, vision_max_batch_size=kind.perception.encoder_batch)
    with phase("read the checkpoint"):
        checkpoint = NemoCheckpoint(visual_checkpoint_path, rename_keys=rename_keys)
        config = checkpoint.config
        per_rank = tensor_parallel_size > 1 and llm_checkpoint_path is None and merged_lora is None and \
            checkpoint.tp_size == tensor_parallel_size
        streamable = merged_lora is None and quantizer is None and tensor_parallel_size == 1
        stream = _llm_stream(checkpoint) if streamable and llm_checkpoint_path is None else None
        # read per rank: the rest now (the embedding merged: rank 0 holds it whole), the LLM's slices rank by rank;
        # streamed: the rest now, the LLM's tensors as they are written
        weights = checkpoint.state_dict(select=(lambda name: name == EMBEDDING or not _is_llm(name)) if per_rank
                                        else (lambda name: not _is_llm(name)) if stream is not None else None)
    with _hashing_sources(visual_checkpoint_path, llm_checkpoint_path) as source:
        if merged_lora is not None:
            merge_extra(weights, merged_lora)
        if llm_checkpoint_path is None:
            merge_lora(weights, config)  # in place, before the perception's thread reads `weights`
        with ThreadPoolExecutor(1, thread_name_prefix="perception-export") as pool:
            # the perception is built and written while the LLM weights are written (mostly outside the GIL)
            perception = pool.submit(_write_perception, kind, model_dir / kind.perception_dir, config, weights,
                                     target, limits, vision_tower_path=vision_tower_path,
                                     audio_frontend=audio_frontend, video_frame_sampling=video_frame_sampling,
                                     export_onnx=export_onnx)
            llm_checkpoint = checkpoint
            if per_rank:
                llm_weights = _NemoRanks(checkpoint, weights[EMBEDDING])
            elif stream is not None:
                llm_weights = stream
            elif llm_checkpoint_path is None:
                llm_weights = select_llm_weights(weights)
            else:
                with phase("read the LLM checkpoint"):
                    llm_checkpoint = NemoCheckpoint(llm_checkpoint_path, rename_keys=rename_keys)
                    llm_weights = (_llm_stream(llm_checkpoint) if streamable else None) or \
                        select_llm_weights(merge_lora(llm_checkpoint.state_dict(), llm_checkpoint.config))
            del weights
            if not _shapes(llm_weights):
                raise EngineError(f"{llm_checkpoint.path} holds no LLM weights; give the LLM checkpoint as "
                                  "llm_checkpoint_path (-lc/--llm_checkpoint)")
            if merged_lora is not None:
                merge_adapter(llm_weights, merged_lora)
            if lora is not None:  # before the LLM is written: a bad adapter fails fast
                vocab_size = int(_shapes(llm_weights)[EMBEDDING].shape[0])
                shapes = DecoderConfig.from_nemo(llm_checkpoint.config, vocab_size=vocab_size)
                for adapter in lora.adapters:
                    check_lora_adapter(shapes, lora.modules, lora.max_rank, adapter.uid, adapter.rank,
                                       adapter.weights)
            tokenizer = llm_checkpoint.tokenizer(tokenizer_path=tokenizer_path)
            llm_config, llm_hashes = _write_llm(
                model_dir / LLM_DIR, llm_checkpoint.config, llm_weights, target,
                None if quantizer is None else lambda config, w: quantizer.apply(config, w, tokenizer),
                tensor_parallel_size, beside)
            if lora is not None:
                save_adapters(model_dir / LLM_DIR / LORA_DIR, lora.adapters, target)
            tokenizer_description = tokenizer.save(model_dir / LLM_DIR)
            (model_dir / LLM_DIR / "tokenizer_description.json").write_text(
                json.dumps(tokenizer_description, indent=2))
            (model_dir / LLM_DIR / "template.json").write_text(
                json.dumps(kind.chat_template(config).to_dict(), indent=2))
            perception_facts = perception.result()
        with phase("hash the checkpoint (the rest of it)"):
            described_source = source.result()

    with phase("hash the other engine files"):
        files = describe_files(model_dir, known=llm_hashes)
    manifest = {
        "format_version": FORMAT_VERSION,
        "model_type": model_type,
        "modality": kind.modality,
        "llm_model_type": llm_model_type,
        "dtype": dtype,
        "tensor_parallel_size": tensor_parallel_size,
        "quantization": llm_config.to_dict()["quantization"],
        "lora": None if lora is None else lora.to_manifest(),
        "lora_merged": None if merged_lora is None else {"uid": merged_lora.uid, **merged_lora.describe()},
        "limits": limits.to_dict(),
        "features_per_item": perception_facts["features_per_item"],
        "source": described_source,
        "package_version": package_version(),
        "files": files,
    }
    (model_dir / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


def _write_perception(kind, folder: Path, config: Any, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                      limits: EngineLimits, *, vision_tower_path: str | None, audio_frontend: str | None,
                      video_frame_sampling: str | None, export_onnx: bool) -> dict[str, Any]:
    """Build the model type's perception from `weights` (read only) and write it into `folder`; its facts."""
    with phase("perception"):
        encoder = kind.build_perception(config, weights, dtype=torch.float32 if dtype == torch.float32 else dtype,
                                        vision_tower_path=vision_tower_path, audio_frontend=audio_frontend)
        facts = kind.save_perception(encoder, folder, config, video_frame_sampling=video_frame_sampling)
        limits.check_export(facts["features_per_item"])
        if export_onnx:
            kind.export_onnx(encoder, folder)
    return facts


class _NemoRanks(dict):
    """The LLM of a checkpoint sharded at the served TP size: the whole embedding now, each rank's file's slices
    when asked (`ranks`)."""

    def __init__(self, checkpoint: NemoCheckpoint, embedding: torch.Tensor):
        super().__init__({EMBEDDING: embedding})
        self.checkpoint = checkpoint

    def ranks(self, config: DecoderConfig, size: int) -> Iterator[tuple[Shard, Iterator[tuple[str, torch.Tensor]]]]:
        for rank in range(size):
            shard = Shard(rank, size)
            yield shard, adopt_nemo_shard(self.checkpoint.rank_state_dict(rank, select=_is_llm), self[EMBEDDING],
                                          config, shard)


def _is_llm(name: str) -> bool:
    return bool(select_llm_weights({name: None}))


def _llm_stream(checkpoint: NemoCheckpoint) -> TensorStream | None:
    """The checkpoint's LLM weights as a stream in its stored order, where they can be written as stored (no LoRA
    adapter to merge into them; `NemoCheckpoint.tensor_stream` says which layouts)."""
    stream = checkpoint.tensor_stream(select=_is_llm)
    return None if stream is None or any(LORA_MARKER in name for name in stream.metas) else stream


def _shapes(weights: dict[str, torch.Tensor] | TensorStream) -> dict[str, torch.Tensor]:
    """Name -> tensor (or meta tensor: its shape and dtype) of LLM weights held or streamed."""
    return weights.metas if isinstance(weights, TensorStream) else weights


def _write_llm(directory: Path, model_config: Any, weights: dict[str, torch.Tensor] | TensorStream,
               dtype: torch.dtype, quantize: Callable[[DecoderConfig, dict[str, torch.Tensor]], DecoderConfig] | None
               = None, tensor_parallel_size: int = 1, beside: BesideLlmWrite | None = None
               ) -> tuple[DecoderConfig, dict[str, str]]:
    """Write the decoder weights (cast to `dtype` as each is written, consuming `weights`: never two copies; a
    stream is written as it is read, in its order; quantized first if asked; one file per rank when tensor
    parallel) and the config; return the config and each weights file's sha256. One rank: ``beside`` is started
    with the file's layout before the write and told when it is written."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab_size = int(_shapes(weights)[EMBEDDING].shape[0])
    decoder_config = DecoderConfig.from_nemo(model_config, vocab_size=vocab_size)
    if tensor_parallel_size > 1:
        try:
            check_tensor_parallel(decoder_config, tensor_parallel_size)
        except ValueError as error:
            raise EngineError(str(error)) from None
        (directory / "config.json").write_text(json.dumps(decoder_config.to_dict(), indent=2))
        return decoder_config, _write_ranks(directory, decoder_config, weights, dtype, tensor_parallel_size)
    if quantize is not None:
        for name in list(weights):
            weights[name] = weights.pop(name).to(dtype).contiguous()
        decoder_config = quantize(decoder_config, weights)
    shapes = _shapes(weights)
    Decoder.from_state_dict(decoder_config, {k: v.to("meta") for k, v in shapes.items()})  # names/shapes check
    (directory / "config.json").write_text(json.dumps(decoder_config.to_dict(), indent=2))
    if beside is not None:  # the file's layout: quantized tensors as they are, the others cast to `dtype`
        beside.start(decoder_config, {name: torch.empty(t.shape, dtype=t.dtype if quantize else dtype, device="meta")
                                      for name, t in shapes.items()})
    total = sum(t.numel() for t in shapes.values()) * dtype.itemsize if quantize is None else \
        sum(t.numel() * t.element_size() for t in shapes.values())
    with phase("write the LLM weights") as note, byte_progress("writing the LLM weights", total) as progress:
        note["detail"] = f"{total / 1e9:.2f} GB"
        if isinstance(weights, TensorStream):
            waits: dict[str, float] = {}
            sha256 = stream_tensors(directory / "model.safetensors", weights.metas, weights.read(), dtype, progress,
                                    waits=waits)
            note["detail"] += (f", read from the checkpoint as written: the writers waited "
                               f"{waits.get('writers', 0.0):.2f} s for the reader, the reader "
                               f"{waits.get('reader', 0.0):.2f} s for the writers")
        else:
            sha256 = write_tensors(directory / "model.safetensors", weights, None if quantize else dtype, progress)
    if beside is not None:
        beside.written()
    return decoder_config, {LLM_WEIGHTS: sha256}


def _write_ranks(directory: Path, config: DecoderConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 size: int) -> dict[str, str]:
    """Each rank's weights file: slices of the whole weights, or of a same-size checkpoint's rank files."""
    ranks = weights.ranks(config, size) if isinstance(weights, _NemoRanks) else \
        ((shard, split_weights(weights, config, shard)) for shard in map(functools.partial(Shard, size=size),
                                                                          range(size)))
    hashes = {}
    with phase("write the LLM weights") as note:
        for shard, tensors in ranks:
            part = dict(tensors)  # views of the whole tensors where they can be (written one at a time)
            Decoder.from_state_dict(config, {k: v.to("meta") for k, v in part.items()}, shard=shard)  # names/shapes
            name = llm_weights_file(shard)
            hashes[name] = write_tensors(directory.parent / name, part, dtype)
        note["detail"] = f"{size} ranks"
    return hashes


@contextlib.contextmanager
def _hashing_sources(*paths: str | Path | None) -> Iterator[Future]:
    """The manifest's `source` entries (name and sha256 of each checkpoint), computed on a thread of its own
    while the block runs; a failing block stops it."""
    stop = threading.Event()
    pool = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-hash")
    try:
        yield pool.submit(lambda: [{"name": Path(p).name,
                                    "sha256": "directory" if Path(p).is_dir() else sha256_file(Path(p), stop)}
                                   for p in paths if p is not None])
    except BaseException:
        stop.set()
        raise
    finally:
        pool.shutdown(wait=False)


def package_version() -> str:
    """This package's installed version ("unknown" when run from a source tree that is not installed)."""
    try:
        return metadata.version("nemo-mm-deploy")
    except metadata.PackageNotFoundError:
        return "unknown"


@dataclass
class Engine:
    """Everything needed to answer requests, read from an engine directory. ``arriving``: the LLM weights still
    being filled in (`load_engine(weights_in_background=True)`); call ``wait_for_weights`` before using their
    values."""

    manifest: dict[str, Any]
    limits: EngineLimits
    decoder: Decoder
    tokenizer: Tokenizer
    template: ChatTemplate
    perception: Perception
    arriving: ArrivingWeights | None = None

    @property
    def model_type(self) -> str:
        return self.manifest["model_type"]

    @property
    def modality(self) -> str:
        return self.manifest["modality"]

    def wait_for_weights(self) -> None:
        """Return once the LLM weights hold their file's values (at once if they were loaded in full); an
        EngineError if the file turned out bad (unreadable, short, or a hash mismatch). A wait that failed (or was
        interrupted) leaves ``arriving`` set: another wait raises again, ``abandon_weights`` stops the fill."""
        if self.arriving is not None:
            self.arriving.wait()
            self.arriving = None

    def abandon_weights(self) -> None:
        """Stop filling the LLM weights in (the load failed after it began)."""
        arriving, self.arriving = self.arriving, None
        if arriving is not None:
            arriving.pending.cancel()


@dataclass
class ArrivingWeights:
    """LLM weights being filled in from their file while the decoder over them is already built, and what must
    follow once they are in: tensors the decoder took as copies of the loaded ones (a dtype cast) copied again,
    the quantized kernels' copies of the weights made again (`quant.kernels.remake_copies`), the hash check
    finished."""

    pending: PendingWeights
    decoder: Decoder
    copied: list[tuple[torch.Tensor, torch.Tensor]]  # (the decoder's tensor, the loaded one it was copied from)
    hash_check: HashCheck | None

    def wait(self) -> None:
        self.pending.wait()
        for tensor, loaded in self.copied:
            tensor.copy_(loaded)
        self.copied = []
        remake_copies([*self.decoder.parameters(), *self.decoder.buffers()])
        if self.hash_check is not None:
            with phase("finish the hash check"):
                self.hash_check.finish()


def read_manifest(model_dir: str | Path) -> dict[str, Any]:
    """The manifest of an engine directory, or an :class:`EngineError` saying what is missing."""
    path = Path(model_dir) / MANIFEST
    if not path.is_file():
        raise EngineError(f"{model_dir} is not an engine directory (no {MANIFEST}); export a checkpoint into it first")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise EngineError(f"{MANIFEST} of {model_dir} is unreadable ({err}); export the checkpoint again") from None
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        version = manifest.get("format_version") if isinstance(manifest, dict) else None
        raise EngineError(f"{path} has format version {version}, this package reads "
                          f"{FORMAT_VERSION}; export the checkpoint again")
    return manifest


def load_engine(model_dir: str | Path, device: str = "cpu", dtype: str | None = None,
                media: MediaPolicy | None = None, verify: bool | None = None, lora: LoraOptions | None = None,
                weights_in_background: bool = False) -> Engine:
    """Load an exported engine directory (no checkpoint, no network) onto ``device``; ``media`` caps decoding.

    File sizes are always checked; sha256 hashes when ``verify`` (None: when the files were not verified in their
    current state before, see `exporter.engine.integrity`). A bad file is an EngineError naming it. The engine's
    LoRA adapters, and those of ``lora``, are served from a ``LoraBank`` on the decoder. A tensor-parallel engine
    loads rank 0's part here (`exporter.runtime.tensor_parallel` starts the other ranks, `load_llm_shard`).

    ``weights_in_background``: where `background_fill` allows, return before the LLM weights' values have
    arrived (``Engine.arriving``): the decoder is built over zeroed tensors at their final addresses and a thread
    fills them in (and finishes the hash check); ``Engine.wait_for_weights()`` must return before anything uses
    their values.
    """
    model_dir = Path(model_dir)
    manifest = read_manifest(model_dir)
    shard = Shard(0, tensor_parallel_size(manifest))
    weights_file = llm_weights_file(shard)
    with phase("check the engine files") as note:
        hash_check = check_files(model_dir, manifest, verify, streamed=[weights_file])
        note["detail"] = "sizes and headers" + ("; hashing the files as they are read" if hash_check else "")
    kind = get_model_type(manifest["model_type"])
    target = torch_dtype(dtype or manifest["dtype"])
    llm_dir = model_dir / LLM_DIR
    limits = EngineLimits(**manifest["limits"])
    digest = hash_check.digests[weights_file] if hash_check else None
    arriving = None
    with ThreadPoolExecutor(1, thread_name_prefix="perception-load") as pool:
        rest = pool.submit(_load_rest, kind, model_dir, device, target, media,  # while the LLM weights stream in
                           limits.vision_max_batch_size)
        if weights_in_background and background_fill(manifest, device, target):
            arriving = _start_llm(model_dir, device, target, digest, hash_check)
            decoder = arriving.decoder
        else:
            decoder = load_llm_shard(model_dir, shard, device, target, digest)
        try:
            if shard.size > 1 and (manifest.get("lora") is not None or (lora is not None and lora.asked)):
                raise EngineError("LoRA adapters are not served with tensor_parallel_size > 1; export the model "
                                  "with tensor_parallel_size 1 to serve them")
            _serve_lora(decoder, manifest.get("lora"), llm_dir / LORA_DIR, lora or LoraOptions())
            tokenizer, template, perception = rest.result()
        except BaseException:
            if arriving is not None:
                arriving.pending.cancel()
            raise
    if hash_check is not None and arriving is None:
        with phase("finish the hash check"):
            hash_check.finish()
    return Engine(manifest, limits, decoder, tokenizer, template, perception, arriving)


def background_fill(manifest: dict[str, Any], device: str | torch.device, dtype: torch.dtype) -> bool:
    """Whether an engine's LLM weights may be filled in beside the warm-up: on a GPU (`BACKGROUND_DEVICE_TYPES`),
    one rank (the other ranks' processes load their parts whole), served in the dtype it was exported in (a cast
    would hold the file's buffer and the cast copy at once, and the KV pool is sized meanwhile). Quantized
    engines and LoRA adapters qualify: their kernels' copies of the weights are made again once the values are in
    (`ArrivingWeights`); a float8 KV cache, calibrated on the weights, is the caller's to exclude."""
    return (torch.device(device).type in BACKGROUND_DEVICE_TYPES and tensor_parallel_size(manifest) == 1
            and dtype == torch_dtype(manifest["dtype"]))


def _start_llm(model_dir: Path, device: str | torch.device, dtype: torch.dtype, digest, hash_check: HashCheck | None
               ) -> ArrivingWeights:
    """The decoder of a one-rank engine over its weights' tensors, zeroed, and their fill from the file started."""
    path = model_dir / LLM_WEIGHTS
    with _llm_weights_errors(LLM_WEIGHTS):
        pending = PendingWeights(path, device)
    decoder = Decoder.from_state_dict(_decoder_config(model_dir), pending.tensors, dtype=dtype, device=device)
    loaded = pending.tensors
    copied = [(tensor, loaded[name]) for name, tensor in decoder.state_dict(keep_vars=True).items()
              if tensor.data_ptr() != loaded[name].data_ptr()]

    # The warm-up times kernel candidates while this fill's copies write into the GPU's memory: PCIe's 10-25 GB/s
    # against the memory's ~3 TB/s may disturb a timing slightly; accepted (a choice is only ever one of the right
    # kernels).
    def fill() -> None:
        with _reading_llm_weights(model_dir, LLM_WEIGHTS, device, "in the background, beside the warm-up") as (
                progress, stats):
            pending.fill(digest, progress, stats)

    return ArrivingWeights(pending.start(fill), decoder, copied, hash_check)


def tensor_parallel_size(manifest: dict[str, Any]) -> int:
    """The ranks an engine's LLM is split over (1 for engines written before tensor parallelism)."""
    return int(manifest.get("tensor_parallel_size", 1))


def load_llm_shard(model_dir: Path, shard: Shard, device: str | torch.device, dtype: torch.dtype,
                   digest=None) -> Decoder:
    """A rank's decoder (`shard`) of an engine on `device` in `dtype`; `digest` is fed its file's bytes."""
    weights = load_llm_weights(model_dir, device, digest, llm_weights_file(shard))
    return Decoder.from_state_dict(_decoder_config(model_dir), weights, dtype=dtype, device=device, shard=shard)


def _decoder_config(model_dir: Path) -> DecoderConfig:
    return DecoderConfig.from_dict(json.loads((model_dir / LLM_DIR / "config.json").read_text()))


def load_llm_weights(model_dir: Path, device: str | torch.device, digest=None,
                     name: str = LLM_WEIGHTS) -> dict[str, torch.Tensor]:
    """The LLM weights of an engine (file `name`) on `device` (`exporter.engine.loading`), logged as the read +
    transfer phase; `digest` is fed the file's bytes."""
    path = model_dir / name
    with _reading_llm_weights(model_dir, name, device) as (progress, stats):
        return load_tensors(path, device, digest, progress, stats)


@contextlib.contextmanager
def _reading_llm_weights(model_dir: Path, name: str, device: str | torch.device, how: str = ""
                         ) -> Iterator[tuple[Callable[[int], None], LoadStats]]:
    """The read + transfer phase of the engine's LLM weights file `name` around the block (which reads it,
    reporting to the progress callback and stats yielded); `how` is added to the phase's detail."""
    stats = LoadStats()
    with _llm_weights_errors(name), phase("LLM weights: read + transfer") as note, \
            byte_progress("loading the LLM weights", (model_dir / name).stat().st_size) as progress:
        yield progress, stats
        note["detail"] = f"{stats.describe()} to {device}" + \
            (f"; reading busy {stats.read_seconds:.2f} s over its threads" if stats.read_seconds else "") + \
            (f"; {how}" if how else "")


@contextlib.contextmanager
def _llm_weights_errors(name: str) -> Iterator[None]:
    """A ValueError from reading LLM weights file `name` (not valid safetensors, or short) as one EngineError."""
    try:
        yield
    except ValueError as error:
        raise EngineError(f"engine file {name} is not a readable safetensors file ({error}); {AGAIN}") from None


def _load_rest(kind, model_dir: Path, device: str, dtype: torch.dtype, media: MediaPolicy | None,
               encoder_batch: int | None) -> tuple[Tokenizer, ChatTemplate, Perception]:
    """Tokenizer, template and perception of an engine."""
    llm_dir = model_dir / LLM_DIR
    tokenizer = load_saved_tokenizer(llm_dir, json.loads((llm_dir / "tokenizer_description.json").read_text()))
    template = ChatTemplate.from_dict(json.loads((llm_dir / "template.json").read_text()))
    with phase("perception"):
        perception = kind.load_perception(model_dir / kind.perception_dir, device=device, dtype=dtype, media=media,
                                          encoder_batch=encoder_batch)
    return tokenizer, template, perception


@dataclass(frozen=True)
class LoraOptions:
    """LoRA asked for at load, next to the engine's own: more adapters, and settings that override the engine's
    (``target_modules``, ``max_rank``, ``max_loras``: the slots, for adapters added while serving)."""

    adapters: tuple[LoraAdapter, ...] = ()
    target_modules: tuple[str, ...] | None = None
    max_rank: int | None = None
    max_loras: int | None = None

    @property
    def asked(self) -> bool:
        return bool(self.adapters) or any(v is not None for v in (self.target_modules, self.max_rank, self.max_loras))


def _serve_lora(decoder: Decoder, stored: dict[str, Any] | None, folder: Path, options: LoraOptions) -> None:
    """Give ``decoder`` a LoRA bank with the engine's adapters (manifest entry ``stored``) and ``options``'."""
    if stored is None and not options.asked:
        return
    stored = stored or {}
    adapters = [*load_adapters(folder, list(stored.get("adapters", {}))), *options.adapters]
    ranks = [adapter.rank for adapter in adapters]
    modules = options.target_modules or stored.get("target_modules")
    max_rank = options.max_rank or stored.get("max_lora_rank") or max(ranks, default=64)
    wanted = options.max_loras or stored.get("max_loras") or 0
    plan = plan_lora(adapters, modules, max_rank, max(wanted, len(adapters), 1))
    bank = LoraBank(decoder, plan.modules, plan.max_rank, plan.max_loras)
    for adapter in adapters:
        bank.add(adapter.uid, adapter.rank, adapter.scale, adapter.weights)
