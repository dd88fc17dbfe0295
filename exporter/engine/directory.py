"""The engine directory: ``export`` writes it from a ``.nemo``, ``load`` serves from it alone.

Layout (docs/engine_format.md)::

    model_dir/manifest.json           format version, model type, modality, dtype, limits, source, package version
    model_dir/visual_engine/          (or perception_engine/) config.json + model.safetensors [+ encoder.onnx]
    model_dir/llm_engine/             config.json, model.safetensors, tokenizer files, template.json
    model_dir/llm_engine/lora/<uid>/  LoRA adapters served per request (adapter.safetensors, adapter.json)
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import NemoCheckpoint
from ..llm.config import DecoderConfig
from ..llm.lora_layers import LoraBank, check_lora_adapter
from ..llm.model import Decoder, select_llm_weights
from ..llm.quant.convert import ExportQuantization
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
from ..media_safety import MediaPolicy
from ..models import Perception, get_model_type
from ..models.templates import ChatTemplate
from .atomic import install, previous_engine, staging_folder
from .errors import EngineError
from .integrity import AGAIN, MANIFEST, check_files, describe_files, mark_verified, sha256_file
from .limits import EngineLimits
from .loading import LoadStats, load_tensors
from .progress import byte_progress, phase
from .writing import write_tensors

FORMAT_VERSION = 2
LLM_DIR = "llm_engine"
LLM_WEIGHTS = f"{LLM_DIR}/model.safetensors"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` → ``torch.bfloat16``; an unknown name is an error listing the supported ones."""
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; supported: {', '.join(DTYPES)}")
    return DTYPES[name]


def export_engine(model_dir: str | Path, visual_checkpoint_path: str | Path, *,
                  delete_existing_files: bool = True, **options: Any) -> dict[str, Any]:
    """Read the checkpoint(s), build perception and LLM, write the engine directory; return the manifest.

    Atomic (`exporter.engine.atomic`): the engine is built and validated beside the previous one, which it then
    replaces; a failure leaves `model_dir` as it was. `options` are `_write_engine`'s.
    """
    model_dir = Path(model_dir)
    previous = previous_engine(model_dir, delete_existing_files)
    with staging_folder(model_dir) as staging:
        manifest = _write_engine(staging, visual_checkpoint_path, **options)
        check_files(staging, manifest, verify=False)  # every file listed, of its size, safetensors readable
        mark_verified(staging, manifest["files"])  # the hashes were just taken from these files
        install(staging, model_dir, previous)
    return manifest


def _write_engine(model_dir: Path, visual_checkpoint_path: str | Path, *, model_type: str = "neva",
                  llm_checkpoint_path: str | Path | None = None, llm_model_type: str = "llama",
                  limits: EngineLimits | None = None, dtype: str = "bfloat16",
                  vision_tower_path: str | None = None, tokenizer_path: str | None = None,
                  export_onnx: bool = False, rename_keys: tuple[str, ...] = (),
                  audio_frontend: str | None = None, video_frame_sampling: str | None = None,
                  quantization: str | None = None, calib_data: str | Path | None = None,
                  device: str = "cpu", lora: LoraPlan | None = None,
                  merged_lora: LoraAdapter | None = None) -> dict[str, Any]:
    """Write a new engine into the empty folder `model_dir`; return its manifest.

    ``quantization`` (``int8_wo``, ``int4_wo``, ``int4_awq``, ``fp8``) stores the LLM layers' weights quantized,
    computed on ``device``; ``calib_data``: int4_awq's calibration prompts (a text file, one per line). ``lora``:
    the LoRA adapters served per request (stored in the engine); ``merged_lora``: one adapter merged into the
    weights instead (its checkpoint's other fine-tuned tensors, a projector say, replace the base's).
    Once the checkpoint is read, its sha256 is taken on a thread of its own (from the page cache, mostly) while the
    perception and the LLM weights are written."""
    kind = get_model_type(model_type)
    quantizer = None if quantization is None and calib_data is None else \
        ExportQuantization.from_options(quantization, calib_data, device)
    target = torch_dtype(dtype)
    limits = limits or EngineLimits()
    if limits.vision_max_batch_size is None:  # the manifest records the model type's default
        limits = replace(limits, vision_max_batch_size=kind.perception.encoder_batch)
    with phase("read the checkpoint"):
        checkpoint = NemoCheckpoint(visual_checkpoint_path, rename_keys=rename_keys)
        config = checkpoint.config
        weights = checkpoint.state_dict()
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
            if llm_checkpoint_path is None:
                llm_weights = select_llm_weights(weights)
            else:
                with phase("read the LLM checkpoint"):
                    llm_checkpoint = NemoCheckpoint(llm_checkpoint_path, rename_keys=rename_keys)
                    llm_weights = select_llm_weights(merge_lora(llm_checkpoint.state_dict(), llm_checkpoint.config))
            del weights
            if not llm_weights:
                raise EngineError(f"{llm_checkpoint.path} holds no LLM weights; give the LLM checkpoint as "
                                  "llm_checkpoint_path (-lc/--llm_checkpoint)")
            if merged_lora is not None:
                merge_adapter(llm_weights, merged_lora)
            if lora is not None:  # before the LLM is written: a bad adapter fails fast
                vocab_size = int(llm_weights["embedding.word_embeddings.weight"].shape[0])
                shapes = DecoderConfig.from_nemo(llm_checkpoint.config, vocab_size=vocab_size)
                for adapter in lora.adapters:
                    check_lora_adapter(shapes, lora.modules, lora.max_rank, adapter.uid, adapter.rank,
                                       adapter.weights)
            tokenizer = llm_checkpoint.tokenizer(tokenizer_path=tokenizer_path)
            llm_config, llm_sha256 = _write_llm(
                model_dir / LLM_DIR, llm_checkpoint.config, llm_weights, target,
                None if quantizer is None else lambda config, w: quantizer.apply(config, w, tokenizer))
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
        files = describe_files(model_dir, known={LLM_WEIGHTS: llm_sha256})
    manifest = {
        "format_version": FORMAT_VERSION,
        "model_type": model_type,
        "modality": kind.modality,
        "llm_model_type": llm_model_type,
        "dtype": dtype,
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


def _write_llm(directory: Path, model_config: Any, weights: dict[str, torch.Tensor], dtype: torch.dtype,
               quantize: Callable[[DecoderConfig, dict[str, torch.Tensor]], DecoderConfig] | None = None
               ) -> tuple[DecoderConfig, str]:
    """Write the decoder weights (cast to `dtype` as each is written, consuming `weights`: never two copies;
    quantized first if asked) and the config; return the config and the weights file's sha256."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab_size = int(weights["embedding.word_embeddings.weight"].shape[0])
    decoder_config = DecoderConfig.from_nemo(model_config, vocab_size=vocab_size)
    if quantize is not None:
        for name in list(weights):
            weights[name] = weights.pop(name).to(dtype).contiguous()
        decoder_config = quantize(decoder_config, weights)
    Decoder.from_state_dict(decoder_config, {k: v.to("meta") for k, v in weights.items()})  # names/shapes check
    (directory / "config.json").write_text(json.dumps(decoder_config.to_dict(), indent=2))
    total = sum(t.numel() for t in weights.values()) * dtype.itemsize if quantize is None else \
        sum(t.numel() * t.element_size() for t in weights.values())
    with phase("write the LLM weights") as note, byte_progress("writing the LLM weights", total) as progress:
        sha256 = write_tensors(directory / "model.safetensors", weights, None if quantize else dtype, progress)
        note["detail"] = f"{total / 1e9:.2f} GB"
    return decoder_config, sha256


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
    """Everything needed to answer requests, read from an engine directory."""

    manifest: dict[str, Any]
    limits: EngineLimits
    decoder: Decoder
    tokenizer: Tokenizer
    template: ChatTemplate
    perception: Perception

    @property
    def model_type(self) -> str:
        return self.manifest["model_type"]

    @property
    def modality(self) -> str:
        return self.manifest["modality"]


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
                media: MediaPolicy | None = None, verify: bool | None = None, lora: LoraOptions | None = None
                ) -> Engine:
    """Load an exported engine directory (no checkpoint, no network) onto ``device``; ``media`` caps decoding.

    File sizes are always checked; sha256 hashes when ``verify`` (None: when the files were not verified in their
    current state before, see `exporter.engine.integrity`). A bad file is an EngineError naming it. The engine's
    LoRA adapters, and those of ``lora``, are served from a ``LoraBank`` on the decoder.
    """
    model_dir = Path(model_dir)
    manifest = read_manifest(model_dir)
    with phase("check the engine files") as note:
        hash_check = check_files(model_dir, manifest, verify, streamed=[LLM_WEIGHTS])
        note["detail"] = "sizes and headers" + ("; hashing the files as they are read" if hash_check else "")
    kind = get_model_type(manifest["model_type"])
    target = torch_dtype(dtype or manifest["dtype"])
    llm_dir = model_dir / LLM_DIR
    decoder_config = DecoderConfig.from_dict(json.loads((llm_dir / "config.json").read_text()))
    limits = EngineLimits(**manifest["limits"])
    with ThreadPoolExecutor(1, thread_name_prefix="perception-load") as pool:
        rest = pool.submit(_load_rest, kind, model_dir, device, target, media,  # while the LLM weights stream in
                           limits.vision_max_batch_size)
        digest = hash_check.digests[LLM_WEIGHTS] if hash_check else None
        weights = load_llm_weights(model_dir, device, digest)
        decoder = Decoder.from_state_dict(decoder_config, weights, dtype=target, device=device)
        del weights
        _serve_lora(decoder, manifest.get("lora"), llm_dir / LORA_DIR, lora or LoraOptions())
        tokenizer, template, perception = rest.result()
    if hash_check is not None:
        with phase("finish the hash check"):
            hash_check.finish()
    return Engine(manifest, limits, decoder, tokenizer, template, perception)


def load_llm_weights(model_dir: Path, device: str | torch.device, digest=None) -> dict[str, torch.Tensor]:
    """The LLM weights of an engine on `device` (`exporter.engine.loading`), logged as the read + transfer phase;
    `digest` is fed the file's bytes."""
    path = model_dir / LLM_WEIGHTS
    stats = LoadStats()
    with phase("LLM weights: read + transfer") as note, \
            byte_progress("loading the LLM weights", path.stat().st_size) as progress:
        try:
            weights = load_tensors(path, device, digest, progress, stats)
        except ValueError as error:
            raise EngineError(f"engine file {LLM_WEIGHTS} is not a readable safetensors file ({error}); "
                              f"{AGAIN}") from None
        note["detail"] = f"{stats.describe()} to {device}" + \
            (f"; reading busy {stats.read_seconds:.2f} s over its threads" if stats.read_seconds else "")
    return weights


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
