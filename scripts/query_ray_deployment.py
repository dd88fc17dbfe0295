#!/usr/bin/env python
"""Ask a model served by deploy_ray.py: a prompt with an image, through the OpenAI-compatible API (default) or
NeMo's client over Triton's HTTP routes (`--api nemo`: `NemoQueryMultimodal("http://host:port", ...)`, any media
file the model takes); prints the answer.

    python scripts/query_ray_deployment.py --port 1024 --model_id demo --prompt "What shape is this?" \\
        --image_path demo/images/red_circle.png
"""

from __future__ import annotations

import argparse
import base64
import json
import mimetypes
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

# scripts/query.py shares its name with the `query` package: keep this folder off the import path.
sys.path = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]

from query import NemoQueryMultimodal, QueryError  # noqa: E402


class AnswerError(RuntimeError):
    """The OpenAI API refused or failed the request; the message is the server's."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="localhost", help="address of the deployment (default: localhost)")
    parser.add_argument("--port", type=int, default=1024, help="port of the deployment (default: 1024)")
    parser.add_argument("--model_id", default="nemo-model", help="the served model's name (default: nemo-model)")
    parser.add_argument("--prompt", default="Describe this image in detail.", help="the question")
    media = parser.add_mutually_exclusive_group()
    media.add_argument("--image_path", help="a local image (with --api nemo: any media file the model takes)")
    media.add_argument("--image_url", help="an image URL the server fetches (http(s) or data:)")
    parser.add_argument("--max_tokens", type=int, default=100, help="most tokens to generate (default: 100)")
    parser.add_argument("--stream", action="store_true", help="print the answer as it is generated")
    parser.add_argument("--api", choices=("openai", "nemo"), default="openai",
                        help="the OpenAI-compatible API (default) or NeMo's client over Triton's HTTP routes")
    parser.add_argument("--model_type", default="neva",
                        help="with --api nemo: the model's type, its deploy_ray.py --model_type (default: neva)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the answer (default: 300)")
    return parser


def openai_answer(args: argparse.Namespace) -> Iterator[str]:
    """The answer's text from /v1/chat/completions (pieces as they come with --stream, else all of it)."""
    content: list[dict] = [{"type": "text", "text": args.prompt}]
    image = args.image_url or (_data_url(Path(args.image_path)) if args.image_path else None)
    if image:
        content.insert(0, {"type": "image_url", "image_url": {"url": image}})
    body = {"model": args.model_id, "max_tokens": args.max_tokens, "stream": args.stream,
            "messages": [{"role": "user", "content": content}]}
    request = urllib.request.Request(f"http://{args.host}:{args.port}/v1/chat/completions",
                                     data=json.dumps(body).encode("utf-8"),
                                     headers={"Content-Type": "application/json"})
    try:
        response = urllib.request.urlopen(request, timeout=args.timeout)
    except urllib.error.HTTPError as error:
        raise AnswerError(_error_message(error.read()) or f"HTTP {error.code} {error.reason}") from None
    with response:
        if not args.stream:
            yield json.loads(response.read())["choices"][0]["message"]["content"]
            return
        for line in response:
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[len(b"data:"):])
            if "error" in chunk:
                raise AnswerError(chunk["error"].get("message", "the server failed the request"))
            for choice in chunk["choices"]:
                yield choice["delta"].get("content") or ""


def nemo_answer(args: argparse.Namespace) -> Iterator[str]:
    """The answer's text from NeMo's client (Triton's HTTP routes of the deployment)."""
    media = args.image_path or args.image_url
    with NemoQueryMultimodal(f"http://{args.host}:{args.port}", args.model_id, args.model_type) as client:
        if args.stream:
            yield from client.query_stream(args.prompt, media, max_output_len=args.max_tokens,
                                           inference_timeout=args.timeout)
        else:
            answers = client.query(args.prompt, media, max_output_len=args.max_tokens, init_timeout=args.timeout,
                                   inference_timeout=args.timeout)
            yield str(answers[0][0])


def _error_message(body: bytes) -> str | None:
    """The message of an OpenAI error body (`{"error": {"message": ...}}`), else the body's text."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body.decode("utf-8", errors="replace").strip() or None


def _data_url(path: Path) -> str:
    kind = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    return f"data:{kind};base64,{base64.b64encode(path.read_bytes()).decode()}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        for piece in (nemo_answer if args.api == "nemo" else openai_answer)(args):
            print(piece, end="", flush=True)
        print()
    except (AnswerError, QueryError, OSError, ValueError) as error:
        print(f"\nquery_ray_deployment.py: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
