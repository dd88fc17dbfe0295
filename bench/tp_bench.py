"""Batch-1 decode step time of a tensor-parallel decoder through the scheduler: TP=1 against TP=N, and whether they
choose the same tokens.

A LLaVA-13B-shaped decoder (hidden 5120, 40 layers, 40 heads, ffn 13824, vocab 32000; random weights, the same on
every run) runs as a served engine does: rank 0's `Scheduler` (paged KV cache, captured step graphs, each step
queued before the last one's token is read) drives the other ranks, which follow its steps.
Step time: `paged_bench.decode_ms` at one row (a 608-position prompt, then 127 timed steps). Tokens: one greedy
request of ``--check_tokens`` new tokens, in ``--dtype`` and again in float32 (bf16's near-ties between random
logits can flip a token when the sums are added in another order; float32 shows the split itself is exact). TP=1
runs in this process on GPU 0; TP=N in N processes (rank r on GPU r, NCCL, small all-reduces through symmetric
memory); ``--compare_nccl`` adds a TP=N run with every all-reduce through NCCL.

    python bench/tp_bench.py                     # 2 GPUs: prints the table, writes $OUT/tp_bench.json
    python bench/tp_bench.py --compare_nccl --no_float32   # the bf16 runs only
    python bench/tp_bench.py --dtype float32     # the float32 runs only, their tokens compared
    python bench/tp_bench.py --tiny              # a tiny float32 shape over 2 gloo processes: checks that it runs
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from pathlib import Path

import torch
import torch.multiprocessing as mp

from exporter.llm.config import DecoderConfig
from exporter.llm.generate import SamplingParams
from exporter.llm.model import Decoder
from exporter.llm.tensor_parallel import Shard, disable_multicast, split_tensor
from exporter.runtime.kv_cache import KVCacheOptions
from exporter.runtime.scheduler import Scheduler
from exporter.runtime.tensor_parallel import follow, join, rank_device

LLAVA_13B = dict(num_layers=40, hidden_size=5120, ffn_hidden_size=13824, num_attention_heads=40,
                 num_query_groups=40, head_dim=128, vocab_size=32000)
TINY = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=4,
            head_dim=16, vocab_size=256)
PROMPT = 608
DECODE_STEPS = 127


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
        del whole
    if shard.size > 1 and config.share_embeddings_and_output_weights:
        raise ValueError("the bench's shapes have their own output layer")
    return Decoder.from_state_dict(config, weights, shard=shard)


def measure(model: Decoder, check_tokens: int, timed_steps: int) -> dict:
    """Rank 0 (or TP=1): the batch-1 decode ms/step over ``timed_steps`` (none: not timed) through a warmed-up
    scheduler, and a greedy request's ``check_tokens`` tokens."""
    from paged_bench import decode_ms  # here: the other ranks' processes need not import it

    scheduler = Scheduler(model, max_slots=2, max_seq_len=PROMPT + max(check_tokens, timed_steps + 64) + 8,
                          eos_id=None, kv_cache=KVCacheOptions(free_gpu_mem_fraction=0.3, enable_reuse=False),
                          max_num_tokens=1024)
    try:  # each step graph is captured by the first step that needs it: the untimed admission and first steps
        ms = decode_ms(scheduler, 1, timed_steps)[0] if timed_steps else None
        generator = torch.Generator(model.device).manual_seed(7)
        prompt = torch.randn(PROMPT, model.config.hidden_size, device=model.device, dtype=model.dtype,
                             generator=generator) * 0.02
        handle = scheduler.submit(prompt, [-1] * PROMPT, SamplingParams(max_output_len=check_tokens))
        while scheduler.step():
            pass
        return {"ms": ms, "tokens": handle.result()}
    finally:
        scheduler.stop()


def _rank(rank: int, size: int, port: int, dtype: str, peer: bool, args: argparse.Namespace, out: Path) -> None:
    shard = Shard(rank, size)
    device = rank_device(args.device, rank)
    tp = join(shard, port, device, getattr(torch, dtype))
    if not peer:
        tp.peer = None
    model = build(TINY if args.tiny else LLAVA_13B, shard, device, getattr(torch, dtype))
    model.tp = tp
    with torch.inference_mode():
        if rank:
            follow(model)
        else:
            result = measure(model, args.check_tokens, _timed_steps(dtype, args))
            tp.send(("stop",))
            result["peer_all_reduce"] = tp.peer is not None
            out.write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


def _timed_steps(dtype: str, args: argparse.Namespace) -> int:
    """Steps timed in a run of ``dtype``: none in the float32 token check beside another timed dtype."""
    if dtype != args.dtype:
        return 0
    return 8 if args.tiny else DECODE_STEPS


def run(size: int, dtype: str, args: argparse.Namespace, peer: bool = True) -> dict:
    """One configuration: TP=1 in this process (``size`` 1), else ``size`` processes; its `measure`."""
    if size == 1:
        with torch.inference_mode():
            model = build(TINY if args.tiny else LLAVA_13B, Shard(), rank_device(args.device, 0), getattr(torch, dtype))
            result = measure(model, args.check_tokens, _timed_steps(dtype, args))
        del model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return result
    from deploy.startup import free_port

    out = Path(os.environ.get("OUT", ".")) / f"tp_bench.rank0.{dtype}{'' if peer else '.nccl'}.json"
    mp.start_processes(_rank, args=(size, free_port(), dtype, peer, args, out), nprocs=size, start_method="spawn")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=2, help="the TP size compared with TP=1")
    parser.add_argument("--device", help="default: cuda (cpu with --tiny)")
    parser.add_argument("--dtype", help="the timed runs' dtype; default: bfloat16 (float32 with --tiny)")
    parser.add_argument("--check_tokens", type=int, default=64, help="greedy tokens compared (also in float32)")
    parser.add_argument("--compare_nccl", action="store_true", help="also time TP=N with NCCL for every all-reduce")
    parser.add_argument("--no_float32", action="store_true",
                        help="skip the float32 token check (its two runs take most of a fresh machine's time)")
    parser.add_argument("--tiny", action="store_true", help="a tiny shape (checks that the script runs)")
    args = parser.parse_args()
    args.device = args.device or ("cpu" if args.tiny else "cuda")
    args.dtype = args.dtype or ("float32" if args.tiny else "bfloat16")
    disable_multicast()
    size, out = args.size, Path(os.environ.get("OUT", "."))
    plan = [("TP=1", 1, args.dtype, True), (f"TP={size}", size, args.dtype, True)]
    plan += [(f"TP={size} NCCL only", size, args.dtype, False)] if args.compare_nccl else []
    plan += [("TP=1 float32", 1, "float32", True), (f"TP={size} float32", size, "float32", True)] \
        if args.dtype != "float32" and not args.no_float32 else []
    print(f"{'':18} {'ms/step':>9} {'x TP=1':>7}  greedy tokens equal to TP=1's (same dtype) before the first "
          f"difference ({args.device}, batch 1, prompt {PROMPT}, timed in {args.dtype})", flush=True)
    runs: dict[str, dict] = {}
    for name, ranks, dtype, peer in plan:  # each printed and saved as it ends (a run cut short keeps the others)
        result = runs[name] = run(ranks, dtype, args, peer)
        one = runs["TP=1" if dtype == args.dtype else "TP=1 float32"]
        result["ratio"] = result["ms"] / one["ms"] if result["ms"] else None
        result["equal_prefix"] = _agreeing(one["tokens"], result["tokens"])
        print(f"{name:18} {result['ms'] or float('nan'):9.3f} {result['ratio'] or float('nan'):7.3f}  "
              f"{result['equal_prefix']}", flush=True)
        summary = {"shape": TINY if args.tiny else LLAVA_13B, "size": size, "device": args.device,
                   "dtype": args.dtype, "runs": runs}
        (out / "tp_bench.json").write_text(json.dumps(summary, indent=2))


def _agreeing(a: list[int], b: list[int]) -> str:
    """How many of ``b``'s tokens equal ``a``'s before the first difference, out of ``len(a)``."""
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"{same}/{len(a)}"


if __name__ == "__main__":
    main()
