#!/usr/bin/env python
"""Export a NeMo multimodal checkpoint and serve it on Triton, or serve an already exported model repository.

NeMo's flags in long and short form; `--config <name or path>.yaml` sets any of them, and flags given on the
command line override the config. With `--visual_checkpoint` the checkpoint is exported into
`--triton_model_repository` and then served; without it the repository must hold an exported model.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # READY is logged as the time since here, imports included

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

from omegaconf import OmegaConf  # noqa: E402

from deploy import DeployPyTriton  # noqa: E402
from deploy.startup import MANIFEST_NAME, DeployError, check_model_repository, check_port_free  # noqa: E402
from wire import MODALITIES, stream_model_name  # noqa: E402

LOGGER = logging.getLogger("deploy_triton")
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"

LLM_MODEL_TYPES = ("gptnext", "gpt", "llama", "falcon", "starcoder", "mixtral", "gemma")

# (short flag, long flag, type, choices, NeMo default, help). argparse itself defaults everything to None,
# so a value from --config is overridden only by a flag actually given.
OPTIONS: tuple[tuple[str | None, str, type, tuple | None, object, str], ...] = (
    (
        "-mod",
        "--modality",
        str,
        MODALITIES,
        None,
        "modality of the model (default: from --model_type)",
    ),
    ("-vc", "--visual_checkpoint", str, None, None, "source .nemo file of the multimodal model to export"),
    ("-lc", "--llm_checkpoint", str, None, None, "source .nemo file of the LLM, if separate"),
    ("-mt", "--model_type", str, None, None, "type of the model (one registered in exporter/models/)"),
    ("-lmt", "--llm_model_type", str, LLM_MODEL_TYPES, "llama", "type of the LLM"),
    ("-tmn", "--triton_model_name", str, None, None, "name clients query the model by (required)"),
    ("-tmv", "--triton_model_version", int, None, 1, "version of the served model"),
    ("-trp", "--triton_port", int, None, 8000, "HTTP port of the Triton server"),
    ("-tha", "--triton_http_address", str, None, "0.0.0.0", "address the Triton server listens on"),
    (
        "-tmr",
        "--triton_model_repository",
        str,
        None,
        None,
        "exported model directory (<tempdir>/trt_model_dir/)",
    ),
    ("-ng", "--num_gpus", int, None, 1,
     "tensor parallel size of an export: GPUs (with --device cpu, CPU processes) the LLM is split over; an exported "
     "engine serves at its own size"),
    ("-dt", "--dtype", str, ("bfloat16", "float16", "float32"), "bfloat16", "dtype of the exported model"),
    ("-mil", "--max_input_len", int, None, 4096, "max input length in tokens"),
    ("-mol", "--max_output_len", int, None, 256, "max output length in tokens"),
    ("-mbs", "--max_batch_size", int, None, 1, "max prompts batched together"),
    ("-mml", "--max_multimodal_len", int, None, 3072, "max number of media features in a batch"),
    ("-vmb", "--vision_max_batch_size", int, None, None,
     "max images, video frames or audio clips encoded at once (default: the model type's, 16 or 8 clips)"),
    (None, "--max_beam_width", int, None, 1, "max num_beams of a request (each beam takes a KV-cache row)"),
    ("-ulp", "--use_lora_plugin", str, ("auto", "float16", "float32", "bfloat16"), None,
     "serve LoRA adapters (they run in the model dtype)"),
    ("-lcp", "--lora_checkpoint_path", str, None, None,
     "NeMo LoRA adapters (.nemo or folder): one, a folder of them, or uid:path entries, comma-separated; each is "
     "served under its uid (exported with -vc, else added to the served engine)"),
    ("-mlr", "--max_lora_rank", int, None, None, "max LoRA rank (default: 64 at export, else the engine's)"),
    (None, "--max_loras", int, None, None,
     "LoRA adapters served at once (default: one per adapter; more leave room for loading while serving)"),
    (None, "--grpc_port", int, None, 8001, "gRPC port of the Triton server"),
    (None, "--metrics_port", int, None, None,
     "port of the Prometheus metrics (this server's and Triton's; default: --triton_port + 2, or a free port)"),
    (
        None,
        "--device",
        str,
        ("cpu", "cuda"),
        None,
        "device to run the model on (default: the exporter's choice)",
    ),
    (
        None,
        "--vision_tower_path",
        str,
        None,
        None,
        "local folder of the vision tower, if not in the checkpoint",
    ),
    (None, "--tokenizer_path", str, None, None, "local tokenizer, if not in the checkpoint"),
    (None, "--audio_frontend", str, ("nemo-2.4", "nemo-2.5"), None,
     "SALM: the NeMo release whose audio front end the checkpoint was trained with (default: its declaration, else nemo-2.5)"),
    (None, "--video_frame_sampling", str, ("training", "nemo-export"), None,
     "LITA/VITA: sample video frames as the model was trained (default) or as NeMo's TensorRT export runtime did"),
    (None, "--quantization", str, None, None,
     "store the LLM layers' weights quantized: int8_wo, int4_wo, int4_awq (calibrated on --calib_data) or fp8"),
    (None, "--calib_data", str, None, None, "int4_awq: calibration prompts, a text file, one a line (default: bundled)"),
    (None, "--kv_cache_free_gpu_mem_fraction", float, None, 0.9,
     "share of the GPU memory left free after loading the model that the paged KV cache takes"),
    (None, "--kv_cache_bytes", int, None, None,
     "bytes of the KV cache: its size on the CPU (default: every row at max_input_len + max_output_len, at most "
     "4 GiB), a cap on the GPU"),
    (None, "--kv_cache_dtype", str, ("auto", "fp8"), "auto",
     "KV-cache storage: the model's dtype, or float8 e4m3 with per-head scales (GPUs with FP8)"),
    (None, "--max_num_tokens", int, None, 2048,
     "prompt positions one scheduler step prefills at most (long prompts are prefilled in chunks between decode steps)"),
    (None, "--openai_port", int, None, None, "port of an OpenAI-compatible HTTP API (/v1/chat/completions)"),
    (None, "--openai_address", str, None, None, "address the OpenAI API listens on (default: --triton_http_address)"),
    (None, "--openai_max_request_bytes", int, None, None,
     "bytes of one OpenAI request body (default: what the media caps allow, media_max_request_bytes (or "
     "media_max_items x media_max_bytes if smaller) as base64, plus 1 MiB of text and 64 KiB: about 44 MB)"),
    (None, "--media_timeout_s", float, None, 10.0,
     "one deadline per media URL: connecting, headers, body and every redirect"),
    (None, "--media_max_bytes", int, None, 20 * 1024 * 1024, "bytes of one media item"),
    (None, "--media_max_image_pixels", int, None, 40_000_000, "width x height of one image"),
    (None, "--media_max_video_frames", int, None, 20_000, "frames of one video"),
    (None, "--media_max_video_duration_s", float, None, 3600.0, "seconds of one video"),
    (None, "--media_max_audio_duration_s", float, None, 600.0, "seconds of one audio clip"),
    (None, "--media_max_items", int, None, 8, "media items in one OpenAI request"),
    (None, "--media_max_request_bytes", int, None, 32 * 1024 * 1024, "bytes of all media of one OpenAI request"),
    (None, "--media_allowed_domains", str, None, None, "comma-separated hosts media URLs may come from (default: any)"),
    (None, "--media_local_dir", str, None, None, "folder media file:// URLs may be read from (default: none)"),
)
OPTIONAL_VALUE = {"use_lora_plugin": "auto"}  # given alone, the flag takes this value
FLAG_OPTIONS = ("streaming", "media_allow_private_networks", "merge_lora", "no_export_kernel_warmup")
DEFAULTS = {long[2:]: default for _, long, _, _, default, _ in OPTIONS} | {"lora_target_modules": None}
DEFAULTS |= {name: False for name in FLAG_OPTIONS} | {"verify_engine": None, "enable_kv_cache_reuse": True}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", help="YAML of settings (a path, or a name in configs/ such as neva)")
    for short, long, kind, choices, default, text in OPTIONS:
        flags = [short, long] if short else [long]
        shown = "" if default is None else f" (default: {default})"
        extra = {"nargs": "?", "const": OPTIONAL_VALUE[long[2:]]} if long[2:] in OPTIONAL_VALUE else {}
        parser.add_argument(*flags, type=kind, choices=choices, default=None, help=text + shown, **extra)
    parser.add_argument(
        "-ltm",
        "--lora_target_modules",
        nargs="+",
        default=None,
        help="modules LoRA adapters may adapt: NeMo's fused attn_qkv, attn_dense, mlp_h_to_4h, mlp_4h_to_h "
        "(default: the ones the adapters adapt)",
    )
    parser.add_argument(
        "--merge_lora",
        action="store_true",
        default=None,
        help="merge the one --lora_checkpoint_path adapter into the exported weights instead of serving it per request",
    )
    parser.add_argument(
        "--no_export_kernel_warmup",
        action="store_true",
        default=None,
        help="on a GPU, do not run the first start's kernel warm-up at export (the engine's kernel cache is then "
        "filled by its first start)",
    )
    parser.add_argument(
        "--streaming",
        action="store_true",
        default=None,
        help="also serve <triton_model_name>_stream, a decoupled model that streams the answer as it is generated",
    )
    parser.add_argument(
        "--verify_engine",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="check the sha256 of every engine file at load (default: when the files were not verified in their "
        "current state before; sizes are always checked)",
    )
    parser.add_argument(
        "--enable_kv_cache_reuse",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="share the KV-cache blocks of identical prompt prefixes (token ids and media) between requests "
        "(default: on)",
    )
    parser.add_argument(
        "--media_allow_private_networks",
        action="store_true",
        default=None,
        help="let media URLs point at loopback and private addresses (off: only public addresses)",
    )
    return parser


def load_config(name_or_path: str) -> dict:
    """Settings from a YAML file given by path or by name in configs/; unknown keys are an error."""
    path = Path(name_or_path)
    if not path.is_file() and (CONFIG_DIR / f"{name_or_path}.yaml").is_file():
        path = CONFIG_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
        raise ValueError(f"config {name_or_path} not found; give a YAML path or one of: {known}")
    values = OmegaConf.to_container(OmegaConf.load(path), resolve=True) or {}
    if not isinstance(values, dict):
        raise ValueError(f"config {path} must be a mapping of settings")
    unknown = sorted(set(values) - set(DEFAULTS))
    if unknown:
        raise ValueError(
            f"config {path} has unknown settings {unknown}; valid ones: {', '.join(sorted(DEFAULTS))}"
        )
    return values


def parse_settings(argv: list[str] | None = None) -> argparse.Namespace:
    """Settings from NeMo's defaults, then --config, then the flags given; validated."""
    given = vars(build_parser().parse_args(argv))
    config_name = given.pop("config")
    settings = dict(DEFAULTS)
    if config_name:
        settings.update(load_config(config_name))
    settings.update({name: value for name, value in given.items() if value is not None})
    _validate(settings)
    return argparse.Namespace(**settings)


def _validate(settings: dict) -> None:
    for _, long, kind, choices, _, _ in OPTIONS:
        value = settings[long[2:]]
        if value is not None and choices and value not in choices:
            raise ValueError(f"{long} {value!r} is not one of {', '.join(choices)}")
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            settings[long[2:]] = value = float(value)  # a YAML config may write 10 for 10.0
        if value is not None and not isinstance(value, kind):
            raise ValueError(f"{long} must be {kind.__name__}, got {value!r}")
    if settings["verify_engine"] not in (None, True, False):
        raise ValueError(f"verify_engine must be true or false, got {settings['verify_engine']!r}")
    if settings["enable_kv_cache_reuse"] not in (True, False):
        raise ValueError(f"enable_kv_cache_reuse must be true or false, got {settings['enable_kv_cache_reuse']!r}")
    fraction = settings["kv_cache_free_gpu_mem_fraction"]
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"--kv_cache_free_gpu_mem_fraction must be in (0, 1], got {fraction}")
    for name in ("kv_cache_bytes", "max_num_tokens"):
        if settings[name] is not None and settings[name] < 1:
            raise ValueError(f"--{name} must be positive, got {settings[name]}")
    if settings["lora_target_modules"] or settings["max_lora_rank"] is not None:
        from exporter.lora import plan_lora  # the exporter only when asked (the script starts without it)

        rank = settings["max_lora_rank"]
        plan_lora([], settings["lora_target_modules"], 1 if rank is None else rank)  # names a bad module or rank
    if settings["merge_lora"] and not (settings["visual_checkpoint"] and settings["lora_checkpoint_path"]):
        raise ValueError("--merge_lora merges an adapter at export: give -vc/--visual_checkpoint and "
                         "-lcp/--lora_checkpoint_path")
    if not settings["triton_model_name"]:
        raise ValueError(
            "no model name: give -tmn/--triton_model_name or set triton_model_name in the config"
        )
    if (settings["quantization"] or settings["calib_data"]) and not settings["visual_checkpoint"]:
        raise ValueError("--quantization and --calib_data apply to an export: give -vc/--visual_checkpoint too")
    if settings["quantization"]:
        from exporter.llm.config import QuantConfig  # the exporter only when asked (the script starts without it)

        QuantConfig(settings["quantization"])  # an unknown method fails here, naming the supported ones
    if settings["triton_model_repository"] is None:
        settings["triton_model_repository"] = str(Path(tempfile.gettempdir()) / "trt_model_dir")
    if settings["visual_checkpoint"] and not settings["model_type"]:
        raise ValueError("exporting a checkpoint needs -mt/--model_type")
    if settings["model_type"]:
        expected = _modality_of(settings)
        if settings["modality"] not in (None, expected):
            raise ValueError(
                f"--model_type {settings['model_type']} takes --modality {expected}, "
                f"not {settings['modality']}"
            )
        settings["modality"] = expected
    settings["modality"] = settings["modality"] or "vision"
    try:
        media_policy(argparse.Namespace(**settings))  # a bad media option fails here, before anything starts
    except ValueError as error:
        raise ValueError(f"a --media_* option is invalid: {error}") from None


def _modality_of(settings: dict) -> str:
    """The modality of --model_type. An engine of that type in the repository records it in its manifest, read
    without importing the exporter (the command line is checked before the slow import); else the model-type
    registry says."""
    if not settings["visual_checkpoint"]:
        try:
            served = json.loads((Path(settings["triton_model_repository"]) / MANIFEST_NAME).read_text())
        except (OSError, ValueError):
            served = None  # no engine there (check_model_repository says so later)
        if isinstance(served, dict) and served.get("model_type") == settings["model_type"] and served.get("modality"):
            return served["modality"]
    from exporter.models import get_model_type  # the registry only when it must say

    return get_model_type(settings["model_type"]).modality


def build_deployable(settings: argparse.Namespace, load: bool = True):
    """The exporter loaded from the repository, or after exporting the checkpoint into it (`load=False`: nothing
    is loaded, the checkpoint is only exported; `load_deployable` loads it later)."""
    exporting = settings.visual_checkpoint is not None
    repository = Path(settings.triton_model_repository)
    if not exporting:
        check_model_repository(repository)
    started = time.perf_counter()
    try:
        from exporter import TensorRTMMExporter
    except ImportError as error:
        raise DeployError(f"the exporter cannot be imported ({error}); check the installation") from error
    LOGGER.info("phase exporter import: %.2f s", time.perf_counter() - started)
    with _failing_as_deploy_error("the export" if exporting else "loading the model repository"):
        exporter = TensorRTMMExporter(model_dir=str(repository), load_model=load and not exporting,
                                      **exporter_options(settings))
        if exporting:
            LOGGER.info("exporting %s into %s", settings.visual_checkpoint, repository)
            exporter.export(**_export_arguments(settings), load_model=load)
    return exporter


def load_deployable(exporter) -> None:
    """Load the engine of an exporter made by `build_deployable(load=False)`."""
    with _failing_as_deploy_error("loading the model repository"):
        exporter.load()


@contextlib.contextmanager
def _failing_as_deploy_error(step: str) -> Iterator[None]:
    """A bad checkpoint, engine or setting raised inside the block as a DeployError naming `step`."""
    try:
        yield
    except (OSError, ValueError, RuntimeError, _checkpoint_error()) as error:
        raise DeployError(f"{step} failed: {type(error).__name__}: {error}") from error


def exporter_options(settings: argparse.Namespace) -> dict:
    """`TensorRTMMExporter`'s keyword arguments for serving, from the settings: modality, device, media policy,
    engine check, KV cache, and the LoRA adapters added to an exported engine at load (an export takes them in)."""
    options = dict(modality=settings.modality, media_policy=media_policy(settings),
                   verify_engine=settings.verify_engine,
                   kv_cache_free_gpu_mem_fraction=settings.kv_cache_free_gpu_mem_fraction,
                   kv_cache_bytes=settings.kv_cache_bytes, kv_cache_dtype=settings.kv_cache_dtype,
                   enable_kv_cache_reuse=settings.enable_kv_cache_reuse, max_num_tokens=settings.max_num_tokens)
    if settings.device:
        options["device"] = settings.device
    if settings.visual_checkpoint is None:
        options.update(lora_checkpoint_path=settings.lora_checkpoint_path, max_lora_rank=settings.max_lora_rank,
                       lora_target_modules=settings.lora_target_modules, max_loras=settings.max_loras)
    return options


def timed(phase: str, action: Callable[[], object]) -> None:
    """Run `action`, then log the phase's time as the exporter logs its own phases."""
    started = time.perf_counter()
    action()
    LOGGER.info("phase %s: %.2f s", phase, time.perf_counter() - started)


def _export_arguments(settings: argparse.Namespace) -> dict:
    """`TensorRTMMExporter.export` arguments: NeMo's, plus the local tower/tokenizer paths when given."""
    arguments = {
        "visual_checkpoint_path": settings.visual_checkpoint,
        "llm_checkpoint_path": settings.llm_checkpoint,
        "model_type": settings.model_type,
        "llm_model_type": settings.llm_model_type,
        "tensor_parallel_size": settings.num_gpus,
        "max_input_len": settings.max_input_len,
        "max_output_len": settings.max_output_len,
        "vision_max_batch_size": settings.vision_max_batch_size,
        "max_batch_size": settings.max_batch_size,
        "max_multimodal_len": settings.max_multimodal_len,
        "max_beam_width": settings.max_beam_width,
        "dtype": settings.dtype,
        "use_lora_plugin": settings.use_lora_plugin,
        "lora_target_modules": settings.lora_target_modules,
        "max_lora_rank": 64 if settings.max_lora_rank is None else settings.max_lora_rank,
        "lora_checkpoint_path": settings.lora_checkpoint_path,
        "merge_lora": settings.merge_lora,
        "max_loras": settings.max_loras,
        "warm_kernels": not settings.no_export_kernel_warmup,
    }
    for name in ("vision_tower_path", "tokenizer_path", "audio_frontend", "video_frame_sampling", "quantization",
                 "calib_data"):
        if getattr(settings, name) is not None:
            arguments[name] = getattr(settings, name)
    return arguments


def media_policy(settings: argparse.Namespace):
    """The media limits (OpenAI API fetching, decoding on every path) from the --media_* options."""
    from exporter.media_safety import MediaPolicy

    domains = settings.media_allowed_domains
    return MediaPolicy(
        timeout_s=settings.media_timeout_s,
        max_bytes=settings.media_max_bytes,
        max_image_pixels=settings.media_max_image_pixels,
        max_video_frames=settings.media_max_video_frames,
        max_video_duration_s=settings.media_max_video_duration_s,
        max_audio_duration_s=settings.media_max_audio_duration_s,
        max_items=settings.media_max_items,
        max_request_bytes=settings.media_max_request_bytes,
        allowed_domains=None if domains is None else tuple(d for d in domains.split(",") if d.strip()),
        allow_private_networks=bool(settings.media_allow_private_networks),
        local_dir=settings.media_local_dir,
    )


def start_openai_server(settings: argparse.Namespace, deployer: DeployPyTriton):
    """The OpenAI-compatible API over the deployed model, listening (None without --openai_port); its requests
    are counted in the server's metrics."""
    if settings.openai_port is None:
        return None
    from deploy.metrics import CountRequests
    from deploy.openai import OpenAIServer, create_app

    app = create_app(deployer.model, settings.triton_model_name, media_policy(settings),
                     settings.openai_max_request_bytes)
    app.add_middleware(CountRequests, metrics=deployer.metrics, kind="openai", prefix="/v1/chat/completions")
    server = OpenAIServer(app, host=settings.openai_address or settings.triton_http_address, port=settings.openai_port)
    server.start()
    return server


def _checkpoint_error() -> type[Exception]:
    """The exporter's error class for a bad .nemo (OSError, caught anyway, if the exporter has none)."""
    try:
        from exporter.checkpoint import NemoCheckpointError
    except ImportError:
        return OSError
    return NemoCheckpointError


def main(argv: list[str] | None = None) -> int:
    """Run the script; returns the exit status (0 after a clean stop, 1 on an error explained on stderr)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    LOGGER.info("phase imports: %.2f s", time.perf_counter() - STARTED)
    try:
        settings = parse_settings(argv)
        address = settings.triton_http_address
        check_port_free(address, settings.triton_port, "HTTP", "--triton_port (-trp)")
        check_port_free(address, settings.grpc_port, "gRPC", "--grpc_port")
        if settings.openai_port is not None:
            check_port_free(settings.openai_address or address, settings.openai_port, "OpenAI API", "--openai_port")
        exporter = build_deployable(settings, load=False)
        deployer = DeployPyTriton(
            model=exporter,
            triton_model_name=settings.triton_model_name,
            triton_model_version=settings.triton_model_version,
            max_batch_size=settings.max_batch_size,
            http_port=settings.triton_port,
            grpc_port=settings.grpc_port,
            address=address,
            streaming=settings.streaming,
            metrics_port=settings.metrics_port,
        )
        deployer.deploy(load=lambda: load_deployable(exporter))  # Triton starts beside the load
        try:
            timed("Triton start", deployer.run)  # Triton is up: the OpenAI front says ready only now
            openai_server = start_openai_server(settings, deployer)
        except (DeployError, ValueError):
            deployer.stop()
            raise
    except (DeployError, ValueError) as error:
        print(f"deploy_triton.py: error: {error}", file=sys.stderr)
        return 1
    names = [settings.triton_model_name] + ([stream_model_name(settings.triton_model_name)] if settings.streaming else [])
    LOGGER.info(
        "serving %s on %s (HTTP %d, gRPC %d)",
        " and ".join(names),
        address,
        settings.triton_port,
        settings.grpc_port,
    )
    LOGGER.info("READY %.2f s after the process started", time.perf_counter() - STARTED)
    try:
        deployer.serve()
    except DeployError as error:
        print(f"deploy_triton.py: error: {error}", file=sys.stderr)
        return 1
    finally:
        if openai_server is not None:
            openai_server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
