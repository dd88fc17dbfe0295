"""Batch-1 decode step time of a tensor-parallel decoder: TP=1 against TP=N, and whether they choose the same tokens.

A LLaVA-13B-shaped decoder (hidden 5120, 40 layers, 40 heads, ffn 13824, vocab 32000; random bf16 weights, the
same on every run) decodes greedily after a prompt of ``--prompt`` positions, through the serving path's
``ForwardStep`` (paged KV cache, captured CUDA graphs; the other ranks follow rank 0's steps as they do when
serving). Step time: the median over ``--steps`` decode steps after the warm-up, each launched and its token read
back. TP=1 runs in this process on GPU 0; TP=N in N processes (rank r on GPU r, NCCL).

    python bench/tp_bench.py                     # 2 GPUs: prints the table, writes $OUT/tp_bench.json
    python bench/tp_bench.py --tiny              # a tiny float32 shape over 2 gloo processes: checks that it runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from exporter.llm.config import DecoderConfig
from exporter.llm.model import Decoder
from exporter.llm.sampling import TokenChooser
from exporter.llm.tensor_parallel import Shard, disable_multicast, split_tensor
from exporter.runtime.cuda_graphs import ForwardStep, Piece
from exporter.runtime.tensor_parallel import follow, join, rank_device

LLAVA_13B = dict(num_layers=40, hidden_size=5120, ffn_hidden_size=13824, num_attention_heads=40,
                 num_query_groups=40, head_dim=128, vocab_size=32000)
TINY = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=4,
            head_dim=16, vocab_size=256)
BLOCK = 16
WARM_UP = 8


def build(shape: dict, shard: Shard, device: str, dtype: torch.dtype) -> Decoder:
    """The rank's part of the decoder: each whole tensor drawn from its own seed (so every rank and TP size sees
    the same model), then cut to the rank's slice."""
    config = DecoderConfig(**shape)
    with torch.device("meta"):
        names = Decoder(config).state_dict()
    weights = {}
    for index, (name, meta) in enumerate(sorted(names.items())):
        generator = torch.Generator(device).manual_seed(index)
        whole = torch.ones(meta.shape, device=device, dtype=dtype) if "layernorm" in name else \
            torch.randn(meta.shape, device=device, dtype=dtype, generator=generator) * 0.02
        part = split_tensor(name, whole, config, shard)
        if part is not None:
            weights[name] = part.clone()
    if shard.size > 1 and config.share_embeddings_and_output_weights:
        raise ValueError("the bench's shapes have their own output layer")
    return Decoder.from_state_dict(config, weights, shard=shard)


def measure(model: Decoder, prompt: int, steps: int) -> tuple[list[float], list[int]]:
    """Greedy decode after a seeded prompt: each decode step's seconds and the tokens chosen."""
    device = model.device
    width = -(-(prompt + WARM_UP + steps + 2) // BLOCK) + 1
    cache = model.new_paged_kv_cache(1 + width, BLOCK)
    tables = torch.arange(1, 1 + width, dtype=torch.int32, device=device).view(1, width)
    step = ForwardStep(model, cache, tables, TokenChooser(1, model.config.vocab_size, device),
                       max_chunk=max(prompt, 32))
    ids = torch.randint(0, model.config.vocab_size, (prompt,), generator=torch.Generator().manual_seed(7))
    _, logits = step.launch(0, 0, [Piece(model.embed(ids.to(device)), 0, tables[0].tolist())])
    token, position, tokens, seconds = int(logits[0].argmax()), prompt, [], []
    for index in range(WARM_UP + steps):
        started = time.perf_counter()
        launched, _ = step.launch(1, position + 1, tokens=[token], positions=[position])
        token = launched.read()[0][0]
        if index >= WARM_UP:
            seconds.append(time.perf_counter() - started)
        tokens.append(token)
        position += 1
    step.close()
    return seconds, tokens


def _rank(rank: int, size: int, port: int, args: argparse.Namespace, out: Path) -> None:
    shard = Shard(rank, size)
    device = rank_device(args.device, rank)
    tp = join(shard, port, device)
    model = build(TINY if args.tiny else LLAVA_13B, shard, device, getattr(torch, args.dtype))
    model.tp = tp
    with torch.inference_mode():
        if rank:
            follow(model)
        else:
            seconds, tokens = measure(model, args.prompt, args.steps)
            tp.send(("stop",))
            out.write_text(json.dumps({"seconds": seconds, "tokens": tokens}))
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=2, help="the TP size compared with TP=1")
    parser.add_argument("--device", help="default: cuda (cpu with --tiny)")
    parser.add_argument("--dtype", help="default: bfloat16 (float32 with --tiny)")
    parser.add_argument("--prompt", type=int, default=608, help="prompt positions (LLaVA-1.5: image + 32 tokens)")
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--tiny", action="store_true", help="a tiny shape (checks that the script runs)")
    args = parser.parse_args()
    args.device = args.device or ("cpu" if args.tiny else "cuda")
    args.dtype = args.dtype or ("float32" if args.tiny else "bfloat16")
    disable_multicast()
    shape = TINY if args.tiny else LLAVA_13B
    with torch.inference_mode():
        model = build(shape, Shard(), rank_device(args.device, 0), getattr(torch, args.dtype))
        seconds, tokens = measure(model, args.prompt, args.steps)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    out = Path(os.environ.get("OUT", ".")) / "tp_bench.rank0.json"
    from deploy.startup import free_port

    mp.start_processes(_rank, args=(args.size, free_port(), args, out), nprocs=args.size, start_method="spawn")
    parallel = json.loads(out.read_text())
    one, many = statistics.median(seconds), statistics.median(parallel["seconds"])
    same = next((i for i, (a, b) in enumerate(zip(tokens, parallel["tokens"])) if a != b), len(tokens))
    rows = [("TP=1", one * 1e3, 1.0, "-"), (f"TP={args.size}", many * 1e3, many / one,
                                             f"{same}/{len(tokens)} equal before the first difference")]
    print(f"{'':6} {'ms/step':>9} {'x TP=1':>7}  tokens ({args.device}, {args.dtype}, prompt {args.prompt}, "
          f"{args.steps} steps)")
    for name, ms, ratio, note in rows:
        print(f"{name:6} {ms:9.3f} {ratio:7.3f}  {note}")
    result = {"shape": shape, "size": args.size, "device": args.device, "dtype": args.dtype,
              "tp1_ms": one * 1e3, "tp_ms": many * 1e3, "ratio": many / one, "equal_prefix": same,
              "tokens": len(tokens)}
    (out.parent / "tp_bench.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
