#!/usr/bin/env python
"""Query a multimodal model served by deploy_triton.py and print its answer (NeMo's flags)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# This script shares its name with the `query` package: keep its own folder off the import path.
sys.path = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]

from query import MediaError, NemoQueryMultimodal, QueryError  # noqa: E402
from query.media import DEFAULT_TIMEOUT_S  # noqa: E402
from query.query_multimodal import DEFAULT_INFERENCE_TIMEOUT_S  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "-u", "--url", default="localhost", help="Triton server: host[:port] (HTTP) or grpc://host:port"
    )
    parser.add_argument("-mn", "--model_name", required=True, help="name of the served model")
    parser.add_argument(
        "-mt", "--model_type", required=True, help="model type of the served model (its deploy_triton.py --model_type)"
    )
    parser.add_argument("-int", "--input_text", required=True, help="the prompt")
    parser.add_argument(
        "-im", "--input_media", help="image, video or audio: a path, http(s) URL or data: URL"
    )
    parser.add_argument("-bs", "--batch_size", type=int, default=1, help="batch size (kept for NeMo)")
    parser.add_argument("-mol", "--max_output_len", type=int, default=128, help="max output tokens")
    parser.add_argument("-tk", "--top_k", type=int, default=1, help="top_k")
    parser.add_argument("-tpp", "--top_p", type=float, default=0.0, help="top_p")
    parser.add_argument("-t", "--temperature", type=float, default=1.0, help="temperature")
    parser.add_argument("-rp", "--repetition_penalty", type=float, default=1.0, help="repetition penalty")
    parser.add_argument("-nb", "--num_beams", type=int, default=1, help="number of beams")
    parser.add_argument(
        "-it", "--init_timeout", type=float, default=60.0, help="seconds to wait for the server"
    )
    parser.add_argument("-lt", "--lora_task_uids", nargs="+", help="LoRA task uids")
    parser.add_argument(
        "-ift",
        "--inference_timeout",
        type=float,
        default=DEFAULT_INFERENCE_TIMEOUT_S,
        help="seconds to wait for the answer",
    )
    parser.add_argument(
        "--media_timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds to fetch a media URL"
    )
    parser.add_argument(
        "--raw_pixels", action="store_true", help="send decoded pixels/samples instead of the file"
    )
    parser.add_argument(
        "--streaming",
        action="store_true",
        help="print the answer as it is generated (the server runs deploy_triton.py --streaming)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Print the answer (one line per beam); on failure print the server's message and return 1."""
    args = build_parser().parse_args(argv)
    client = NemoQueryMultimodal(
        args.url,
        args.model_name,
        args.model_type,
        raw_pixels=args.raw_pixels,
        media_timeout_s=args.media_timeout,
    )
    try:
        if args.streaming:
            return _print_stream(client, args)
        with client:
            answers = client.query(**_query_arguments(args), batch_size=args.batch_size, num_beams=args.num_beams)
    except (QueryError, MediaError, ValueError) as error:
        print(f"query.py: error: {error}", file=sys.stderr)
        return 1
    for beams in answers:
        for answer in beams:
            print(answer)
    return 0


def _query_arguments(args: argparse.Namespace) -> dict:
    """The arguments `query` and `query_stream` share, from the command line."""
    return {
        "input_text": args.input_text,
        "input_media": args.input_media,
        "max_output_len": args.max_output_len,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "temperature": args.temperature,
        "repetition_penalty": args.repetition_penalty,
        "init_timeout": args.init_timeout,
        "lora_uids": args.lora_task_uids,
        "inference_timeout": args.inference_timeout,
    }


def _print_stream(client: NemoQueryMultimodal, args: argparse.Namespace) -> int:
    """Print the pieces of one streamed answer as they arrive, then a newline."""
    if args.num_beams != 1:
        raise QueryError("--streaming returns one answer; leave --num_beams at 1")
    pieces = client.query_stream(**_query_arguments(args))
    for piece in pieces:
        print(piece, end="", flush=True)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
