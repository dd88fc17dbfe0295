"""``TensorRTMMExporter``: NeMo's public multimodal exporter class and signatures over this package's engine.

``export`` writes an engine directory from a ``.nemo``; ``forward`` answers text + media; the Triton methods make it
servable by ``deploy.DeployPyTriton``. The engines are PyTorch (CPU or CUDA); ``export_onnx=True`` also writes the
vision encoder as ONNX, the file a TensorRT build consumes elsewhere.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from wire import (
    MODALITIES,
    InferRequest,
    ITritonDeployable,
    RequestRow,
    WireLimits,
    default_warmup_request,
    encode_outputs,
    lora_uids_per_row,
    multimodal_triton_inputs,
    multimodal_triton_outputs,
    served_parameters,
    split_request,
)

from .engine import Engine, EngineLimits, LoraOptions, export_engine, load_engine, read_manifest
from .engine.directory import tensor_parallel_size as engine_tensor_parallel_size
from .engine.kernel_cache import KernelCache, Restored, compile_summary
from .engine.prefetch import prefetch_engine
from .engine.progress import phase, thread_disk_reads
from .engine.read_ahead import read_ahead
from .llm.generate import SamplingParams
from .llm.lora_layers import LoraBank
from .llm.parallel_compile import start_workers, stop_workers
from .lora import LoraError, plan_lora, read_adapter, read_adapters
from .media_safety import MediaPolicy
from .models import get_model_type
from .runtime import Completion, Pipeline, Request
from .runtime.kernel_warmup import ExportKernelWarmUp
from .runtime.kv_cache import KVCacheOptions
from .runtime.tensor_parallel import Ranks

BACKENDS = ("torch",)


class InvalidModalityError(ValueError, AssertionError):
    """The modality is not one of ``vision`` / ``audio`` (an AssertionError too, as NeMo raised)."""


class TensorRTMMExporter(ITritonDeployable):
    """Export a NeMo multimodal checkpoint to an engine directory and run or serve it.

    ``model_dir`` is the engine directory; with ``load_model=True`` an existing engine there is loaded at once (its
    files read into the page cache ahead of and beside the load: a cold start's disk reads overlap).
    ``media_policy`` caps the media the model decodes (image pixels, video frames and duration, audio bytes and
    duration); None keeps each model type's defaults. ``verify_engine``: check the engine files' sha256 at load
    (None: when not verified in their current state before; sizes are always checked).
    The KV cache (TensorRT-LLM's names): ``kv_cache_free_gpu_mem_fraction`` of the GPU memory left free after the
    model is loaded is taken by the paged cache; ``kv_cache_bytes`` is its size on the CPU (a cap on CUDA);
    ``kv_cache_dtype`` "auto" (the model's) or "fp8"; ``enable_kv_cache_reuse`` shares the blocks of identical
    prompt prefixes between requests; ``max_num_tokens`` caps the prompt positions one step prefills.

    LoRA at load, next to the adapters the engine holds: ``lora_checkpoint_path`` serves more NeMo LoRA adapters
    (see ``export``); ``lora_target_modules`` and ``max_lora_rank`` override the engine's; ``max_loras`` is how
    many adapters can be served at once (default: as many as there are), room for ``load_lora`` while serving.
    """

    def __init__(self, model_dir: str | Path, load_model: bool = True, modality: str = "vision",
                 device: str | None = None, media_policy: MediaPolicy | None = None,
                 verify_engine: bool | None = None, *, lora_checkpoint_path: str | Path | Sequence[str] | None = None,
                 lora_target_modules: Sequence[str] | None = None, max_lora_rank: int | None = None,
                 max_loras: int | None = None, kv_cache_free_gpu_mem_fraction: float = 0.9,
                 kv_cache_bytes: int | None = None, kv_cache_dtype: str = "auto", enable_kv_cache_reuse: bool = True,
                 max_num_tokens: int | None = None):
        if modality not in MODALITIES:
            raise InvalidModalityError(f"modality must be one of {MODALITIES}, got {modality!r}")
        self.model_dir = Path(model_dir)
        self.modality = modality
        self.device = device or _default_device()
        self.media_policy = media_policy
        self.verify_engine = verify_engine
        self.lora = LoraOptions(tuple(read_adapters(lora_checkpoint_path)),
                                None if lora_target_modules is None else tuple(lora_target_modules), max_lora_rank,
                                max_loras)
        self.kv_cache = KVCacheOptions(free_gpu_mem_fraction=kv_cache_free_gpu_mem_fraction, max_bytes=kv_cache_bytes,
                                       dtype=kv_cache_dtype, enable_reuse=enable_kv_cache_reuse)
        self.max_num_tokens = max_num_tokens
        self.engine: Engine | None = None
        self.pipeline: Pipeline | None = None
        self.ranks: Ranks | None = None
        self._wrote_engine = False
        if load_model and (self.model_dir / "manifest.json").is_file():
            self.load()

    def load(self) -> None:
        """Load the engine exported in ``model_dir`` (what ``load_model=True`` does at construction); an
        EngineError names what is missing or bad."""
        if not self._wrote_engine:
            # a start from a cold disk: its other reads before the weights' stream, which they would wait behind,
            # then what they left (the LLM weights) read in the background while the load goes on (not after this
            # exporter's export: the files it wrote are in the page cache)
            prefetch_engine(read_ahead(self.model_dir, self.device).stream)
        self._load()

    def export(
        self,
        visual_checkpoint_path: str | Path,
        llm_checkpoint_path: str | Path | None = None,
        model_type: str = "neva",
        llm_model_type: str = "llama",
        tensor_parallel_size: int = 1,
        max_input_len: int = 4096,
        max_output_len: int = 256,
        max_batch_size: int = 1,
        vision_max_batch_size: int | None = None,
        max_multimodal_len: int = 3072,
        dtype: str = "bfloat16",
        delete_existing_files: bool = True,
        load_model: bool = True,
        use_lora_plugin: str | None = None,
        lora_target_modules: Sequence[str] | None = None,
        lora_checkpoint_path: str | Path | None = None,
        max_lora_rank: int = 64,
        *,
        vision_tower_path: str | None = None,
        tokenizer_path: str | None = None,
        backend: str = "torch",
        export_onnx: bool = False,
        nemo_rename_key: Sequence[str] = (),
        audio_frontend: str | None = None,
        video_frame_sampling: str | None = None,
        quantization: str | None = None,
        calib_data: str | Path | None = None,
        max_beam_width: int = 1,
        merge_lora: bool = False,
        max_loras: int | None = None,
        warm_kernels: bool = True,
    ) -> None:
        """Write the engine directory (NeMo's arguments; the keyword-only ones are this package's).

        ``audio_frontend`` (SALM): ``"nemo-2.4"`` or ``"nemo-2.5"``, the NeMo release whose audio front end the
        checkpoint was trained with (see docs/fidelity.md); default the checkpoint's declaration, else ``"nemo-2.5"``.
        ``video_frame_sampling`` (LITA/VITA): ``"training"`` (default) samples frames as NeMo trained the model,
        ``"nemo-export"`` as NeMo's TensorRT export runtime did (see docs/fidelity.md).
        ``vision_max_batch_size``: the most images, video frames or audio clips one encoder call takes (NeMo's
        name; default the model type's: 16 images or frames, 8 clips).
        ``quantization``: store the LLM layers' weights as ``int8_wo``, ``int4_wo``, ``int4_awq`` or ``fp8``
        (quantized on this exporter's device; see docs/fidelity.md); ``calib_data``: a text file of prompts, one a
        line, for int4_awq's calibration (default: prompts bundled with the package).

        LoRA: ``lora_checkpoint_path`` names NeMo LoRA adapters (PEFT ``.nemo`` files or folders, TP shards too):
        one, a folder of them, ``uid:path`` entries, or a list or comma-separated string of these; each is served
        under its uid (its file name without ``.nemo`` unless given), chosen per request by ``lora_uids``, on the
        modules ``lora_target_modules`` names (default: the ones the adapters adapt; NeMo's fused ``attn_qkv``,
        ``attn_dense``, ``mlp_h_to_4h``, ``mlp_4h_to_h``) with ranks up to ``max_lora_rank``. ``use_lora_plugin``
        (any value) serves LoRA without adapters at export (added at load or with ``load_lora``); the adapters run
        in the model dtype. ``max_loras``: adapters served at once (default: one slot per adapter). ``merge_lora``:
        merge the one adapter into the weights instead (NeMo's forward: scale alpha/dim; see docs/fidelity.md).

        ``tensor_parallel_size`` N > 1 splits the LLM over N ranks (N GPUs, or N CPU processes): the engine holds
        one weights file per rank, and loading it starts ranks 1..N-1 beside this process (docs/serving.md).

        ``warm_kernels``: on a CUDA device (this exporter's), one rank and no LoRA adapters served per request, run a
        first start's kernel warm-up for this GPU beside the LLM weights' write and keep it in the engine's kernel
        cache (`exporter.runtime.kernel_warmup`): the first start after the export skips it. A failed warm-up is a
        logged warning; the engine is exported without it.
        """
        kind = get_model_type(model_type)
        if kind.modality != self.modality:
            raise InvalidModalityError(
                f"model_type {model_type!r} takes modality {kind.modality!r}, but this exporter was created with "
                f"modality={self.modality!r}"
            )
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {tensor_parallel_size!r}")
        adapters = read_adapters(lora_checkpoint_path)
        lora = merged = None
        if merge_lora:
            if len(adapters) != 1:
                raise LoraError(f"merge_lora=True merges one LoRA adapter; lora_checkpoint_path names {len(adapters)}")
            merged = adapters[0]
        elif adapters or use_lora_plugin:
            lora = plan_lora(adapters, lora_target_modules, max_lora_rank, max_loras)
        limits = EngineLimits(max_input_len=max_input_len, max_output_len=max_output_len,
                              max_batch_size=max_batch_size, max_multimodal_len=max_multimodal_len,
                              vision_max_batch_size=vision_max_batch_size, max_beam_width=max_beam_width)
        export_engine(self.model_dir, visual_checkpoint_path, delete_existing_files=delete_existing_files,
                      model_type=model_type,
                      llm_checkpoint_path=llm_checkpoint_path, llm_model_type=llm_model_type, limits=limits,
                      dtype=dtype, vision_tower_path=vision_tower_path, tokenizer_path=tokenizer_path,
                      export_onnx=export_onnx, rename_keys=tuple(nemo_rename_key), audio_frontend=audio_frontend,
                      video_frame_sampling=video_frame_sampling,
                      quantization=quantization, calib_data=calib_data, device=self.device, lora=lora,
                      merged_lora=merged, tensor_parallel_size=tensor_parallel_size,
                      beside=_export_warm_up(self.model_dir, self.device, dtype, limits, warm_kernels=warm_kernels,
                                             tensor_parallel_size=tensor_parallel_size, lora=lora is not None))
        self._wrote_engine = True
        if load_model:
            self._load()

    def _load(self) -> None:
        manifest = read_manifest(self.model_dir)
        if manifest["modality"] != self.modality:
            raise InvalidModalityError(f"the engine in {self.model_dir} is for modality {manifest['modality']!r}, "
                                       f"not {self.modality!r}")
        self.close()
        kernels = KernelCache.for_device(self.model_dir, self.device) if self.device.startswith("cuda") else None
        size = engine_tensor_parallel_size(manifest)
        if size > 1 and self.kv_cache.dtype == "fp8":
            raise ValueError("kv_cache_dtype fp8 is not served with tensor_parallel_size > 1; use kv_cache_dtype auto")
        restored = None
        if kernels is not None:
            kernels.use_compile_dirs()  # before anything compiles
            # once, before anything chooses a kernel: both the workers' start and the compile-ahead pass follow it
            restored = kernels.restore()
            if size == 1 and not restored.hit:
                start_workers()  # a first start compiles its kernels ahead in worker processes: they start meanwhile
        with phase("load the engine"):
            if size > 1:  # the other ranks load their parts meanwhile
                self.ranks = Ranks(self.model_dir, size, self.device, manifest["dtype"])
            try:
                # on a GPU the LLM weights arrive while the warm-up runs (a float8 KV cache is calibrated on them)
                self.engine = load_engine(self.model_dir, device=self.device, media=self.media_policy,
                                          verify=self.verify_engine, lora=self.lora,
                                          weights_in_background=self.kv_cache.dtype != "fp8")
            except BaseException:
                stop_workers()
                self.close()
                raise
            self.engine.decoder.tp = None if self.ranks is None else self.ranks.tp
        try:
            self._warm_up(kernels, restored)
            if self.engine.arriving is not None:
                with phase("wait for the LLM weights") as note:
                    note["detail"] = "they arrived during the warm-up" if self.engine.arriving.pending.done() \
                        else "the warm-up ended first"
                    self.engine.wait_for_weights()
        except BaseException:
            self.engine.abandon_weights()
            self.close()
            self.engine = None
            raise

    def _warm_up(self, kernels: KernelCache | None, restored: Restored | None) -> None:
        """Build the pipeline (its KV pool, its scheduler capturing the step graphs a first request runs on a GPU),
        the kernel cache `restored` before the load and saved after; the phase line's detail times each part (the
        restore apart: it is no part of the phase). The LLM weights' values may still be arriving: nothing here
        keeps what it computes from them."""
        with phase("warm-up: compile, choose kernels, capture graphs") as note:
            started, disk_before = time.perf_counter(), thread_disk_reads()
            # kernels restored from the cache load from Triton's disk cache: nothing to compile ahead
            self.pipeline = Pipeline(self.engine, kv_cache=self.kv_cache, max_num_tokens=self.max_num_tokens,
                                     compile_kernels_ahead=restored is None or not restored.hit)
            stop_workers()  # where the pass did not run (it stops them itself)
            scheduler = self.pipeline.scheduler
            stats = scheduler.capture_stats
            parts = {"pipeline built": self.pipeline.build_s, "captures": stats.get("before_s", 0.0)}
            details = []
            if restored is not None:
                details.append(f"{restored.describe()} (restore before the load: {restored.seconds:.2f} s)")
            details.append(f"pipeline built in {parts['pipeline built']:.2f} s (KV pool {scheduler.kv_pool_s:.2f} s)")
            details.append(_describe_capture(stats))
            if kernels is not None:
                scheduler.on_captured = kernels.save  # the background captures' choices too
                saving = time.perf_counter()
                saved = kernels.save()
                parts["kernel cache save"] = time.perf_counter() - saving
                details.append(f"kernel cache {'saved' if saved else 'not saved'} in "
                               f"{parts['kernel cache save']:.2f} s")
            compiled = compile_summary()
            details.append(compiled and f"{compiled} (inside the pipeline build and the warm-up runs)")
            details.append(f"other {time.perf_counter() - started - sum(parts.values()):.2f} s")
            disk_after = thread_disk_reads()
            if disk_before is not None and disk_after is not None:
                details.append(f"its thread read {(disk_after - disk_before) / 1e6:.1f} MB from the disk")
            note["detail"] = "; ".join(detail for detail in details if detail)

    def close(self) -> None:
        """Stop serving: the scheduler, and a tensor-parallel engine's other ranks."""
        if self.pipeline is not None:
            self.pipeline.close()
            self.pipeline = None
        if self.ranks is not None:
            self.ranks.stop()
            self.ranks = None

    def forward(
        self,
        input_text: str | Sequence[str],
        input_media: Any = None,
        batch_size: int = 1,
        max_output_len: int = 30,
        top_k: int = 1,
        top_p: float = 0.0,
        temperature: float = 1.0,
        repetition_penalty: float = 1.0,
        num_beams: int = 1,
        lora_uids: Sequence[str] | None = None,
        apply_chat_template: bool = True,
    ) -> list[list[str]]:
        """Answer one prompt, or a list of prompts with one media entry each; returns ``[batch][beam]`` strings.

        ``lora_uids``: the LoRA adapter of every prompt (one uid), or of each (one per prompt); ``"-1"``: none.
        The first failing request raises its error (use the Triton path for per-request errors).
        """
        pipeline = self._require_pipeline()
        texts = [input_text] if isinstance(input_text, str) else list(input_text)
        media = list(input_media) if isinstance(input_media, (list, tuple)) and not isinstance(input_text, str) \
            else [input_media] * len(texts)
        if len(media) != len(texts):
            raise ValueError(f"got {len(texts)} prompts but {len(media)} media entries; give one per prompt")
        uids = lora_uids_per_row(lora_uids, len(texts))
        pipeline.engine.limits.check_batch(len(texts))
        params = SamplingParams(max_output_len=max_output_len, top_k=top_k, top_p=top_p, temperature=temperature,
                                repetition_penalty=repetition_penalty, num_beams=num_beams)
        results = pipeline.run([Request(t, m, params, apply_chat_template, lora_uid=uid)
                                for t, m, uid in zip(texts, media, uids)])
        self.serving_started()  # no server says READY here: the first request answered does
        for result in results:
            if isinstance(result, Exception):
                raise result
        return [result.texts for result in results]  # type: ignore[union-attr]

    def generate(self, requests: Sequence[Request]) -> list[Completion | Exception]:
        """Answer pipeline requests together; each gets its :class:`Completion` or its own exception."""
        results = self._require_pipeline().run(list(requests))
        self.serving_started()
        return results

    def serving_started(self) -> None:
        """The server is READY (or the first requests are answered): the step graphs the warm-up left for later
        are captured from now on, one at a time while no request runs."""
        self._require_pipeline().scheduler.capture_in_background()

    def stream(self, request: Request) -> Iterator[str]:
        """Yield the text of one request's answer piece by piece as it is generated."""
        return self._require_pipeline().stream(request)

    # --- LoRA adapters while serving --------------------------------------------------------------------------------

    @property
    def lora_uids(self) -> list[str]:
        """The LoRA adapters served now, by uid (none without an engine or LoRA)."""
        bank = None if self.engine is None else self.engine.decoder.lora
        return [] if bank is None else bank.uids

    def load_lora(self, uid: str, lora_checkpoint_path: str | Path) -> None:
        """Serve one more NeMo LoRA adapter under ``uid`` now, in a free slot (``max_loras``); requests name it at
        once. It must fit the engine's ``lora_target_modules`` and ``max_lora_rank``."""
        bank = self._lora_bank()
        adapter = read_adapter(lora_checkpoint_path, uid)
        plan_lora([adapter], bank.modules, bank.max_rank)
        bank.add(adapter.uid, adapter.rank, adapter.scale, adapter.weights)

    def unload_lora(self, uid: str) -> None:
        """Stop serving adapter ``uid`` (requests already using it finish with it; its slot is then free)."""
        self._lora_bank().remove(uid)

    def _lora_bank(self) -> LoraBank:
        bank = self._require_pipeline().engine.decoder.lora
        if bank is None:
            raise LoraError("this model serves no LoRA adapters; export it with use_lora_plugin or "
                            "lora_checkpoint_path, or load it with max_loras")
        return bank

    def _require_pipeline(self) -> Pipeline:
        if self.pipeline is None:
            raise RuntimeError(f"the model should be exported and loaded first: no engine in {self.model_dir}; "
                               "call export(...) or point model_dir at an exported engine directory")
        return self.pipeline

    # --- Triton (ITritonDeployable) ---------------------------------------------------------------------------------

    @property
    def get_triton_input(self):
        return multimodal_triton_inputs(self.modality)

    @property
    def get_triton_output(self):
        return multimodal_triton_outputs()

    def triton_warmup_request(self) -> InferRequest:
        """The default warm-up request, asking for a single token so that it fits any engine's limits."""
        request = default_warmup_request(self.get_triton_input)
        request["max_output_len"] = np.array([[1]], dtype=np.int_)
        return request

    def triton_infer_fn(self, **inputs: np.ndarray) -> dict[str, np.ndarray]:
        """Answer one Triton request (its rows together), as soon as its own rows are done; a failed row raises.

        Called from each Triton instance's thread: concurrent requests share the in-flight scheduler's decode steps.
        """
        rows = split_request(inputs, self._wire_limits())
        results = self._require_pipeline().run([_pipeline_request(row) for row in rows])
        for result in results:
            if isinstance(result, Exception):
                raise result
        return encode_outputs([result.texts for result in results])  # type: ignore[union-attr]

    def triton_stream_request(self, request: InferRequest) -> Iterator[dict[str, np.ndarray]]:
        """Stream the answer of a one-prompt request: each item's ``outputs`` holds the next piece of text.

        A bad request raises at the first item; closing the iterator early cancels the generation.
        """
        rows = split_request(request, self._wire_limits())
        if len(rows) != 1:
            raise ValueError(f"a streamed request holds one prompt, got {len(rows)}; send each prompt on its own")
        pieces = self.stream(_pipeline_request(rows[0]))
        try:
            for piece in pieces:
                yield encode_outputs([[piece]])
        finally:
            pieces.close()

    def triton_model_parameters(self) -> dict[str, str]:
        """The model type and the media kinds it takes, for clients to read from the Triton config (known from
        ``model_dir``'s manifest before the engine is loaded)."""
        model_type = self._served_manifest()["model_type"]
        return served_parameters(model_type, get_model_type(model_type).perception.media)

    def triton_input_byte_caps(self) -> dict[str, int]:
        """Per-request byte caps of the inputs, from the engine's limits and the media policy (known from
        ``model_dir``'s manifest before the engine is loaded)."""
        return self._wire_limits(EngineLimits(**self._served_manifest()["limits"])).input_byte_caps()

    def _served_manifest(self) -> dict[str, Any]:
        """The loaded engine's manifest, else the one in ``model_dir`` (an EngineError if there is none)."""
        return self.pipeline.engine.manifest if self.pipeline is not None else read_manifest(self.model_dir)

    def _wire_limits(self, limits: EngineLimits | None = None) -> WireLimits:
        """The caps a Triton request is checked against before anything in it is decoded (``limits``: the loaded
        engine's by default)."""
        limits = limits or self._require_pipeline().engine.limits
        policy = self.media_policy or MediaPolicy()
        return WireLimits.for_engine(
            max_input_len=limits.max_input_len, max_batch_size=limits.max_batch_size,
            max_media_items=policy.max_items, max_media_item_bytes=policy.max_bytes,
            max_image_pixels=policy.max_image_pixels, max_frames=policy.max_video_frames,
            max_audio_duration_s=policy.max_audio_duration_s)


def _pipeline_request(row: RequestRow) -> Request:
    if row.media_bytes is not None:
        media: Any = row.media_bytes[0] if len(row.media_bytes) == 1 else list(row.media_bytes)
    elif row.media is not None:
        media = row.media  # [images or frames, H, W, 3]: the model type decides which
    else:
        media = row.signal
    return Request(row.text, media, SamplingParams(**row.sampling), lora_uid=row.lora_uid)


def _export_warm_up(model_dir: Path, device: str, dtype: str, limits: EngineLimits, *, warm_kernels: bool,
                    tensor_parallel_size: int, lora: bool) -> ExportKernelWarmUp | None:
    """The kernel warm-up run beside an export's LLM write, where it applies: asked (``warm_kernels``), on a GPU,
    one rank (the other ranks' kernels are their processes') and no LoRA adapters served per request (``lora``:
    their kernels depend on the adapters served at load)."""
    wanted = warm_kernels and device.startswith("cuda") and tensor_parallel_size == 1 and not lora
    return ExportKernelWarmUp(model_dir, device, dtype, limits) if wanted else None


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _describe_capture(stats: dict[str, float]) -> str:
    """The warm-up's step graphs, for its phase line: captured before READY (the warm-up runs' time, which holds
    compiling and choosing kernels, and the captures'), and left for the background."""
    if not stats.get("before") and not stats.get("left"):
        return ""
    return (f"{stats['before']:.0f} step graphs captured in {stats['before_s']:.2f} s (warm-up runs "
            f"{stats.get('before_runs_s', 0.0):.2f} s, captures {stats.get('before_capture_s', 0.0):.2f} s), "
            f"{stats['left']:.0f} left for the background")
