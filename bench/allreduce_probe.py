"""Latency of one decode row's all-reduce (5120 bf16 values) between 2 GPUs: NCCL against symmetric memory's
one-shot all-reduce (torch.ops.symm_mem, no multicast), eagerly and inside a CUDA graph of 80 (a 40-layer decode
step's count). Prints one line of µs figures.

    python bench/allreduce_probe.py      # 2 GPUs (nvidia-h200-x2)
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from exporter.llm.tensor_parallel import disable_multicast

IN_GRAPH = 80


def _microseconds(fn: Callable[[], object], calls: int) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / calls * 1e6


def _graphed(fn: Callable[[], object]) -> float:
    """µs per call of ``fn`` replayed IN_GRAPH times in one graph."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(IN_GRAPH):
            fn()
    return _microseconds(graph.replay, 50) / IN_GRAPH


def _rank(rank: int, port: int) -> None:
    from torch.distributed import _symmetric_memory as symmetric

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    row = torch.randn(1, 5120, device="cuda", dtype=torch.bfloat16)
    for _ in range(10):
        dist.all_reduce(row)
    name = dist.group.WORLD.group_name
    staged = symmetric.empty(1, 5120, device="cuda", dtype=torch.bfloat16)
    symmetric.rendezvous(staged, name)
    staged.copy_(row)

    def one_shot() -> object:
        return torch.ops.symm_mem.one_shot_all_reduce(staged, "sum", name)

    one_shot()
    result = {"nccl_eager": _microseconds(lambda: dist.all_reduce(row), 200), "nccl_graph": _graphed(
        lambda: dist.all_reduce(row)), "one_shot_eager": _microseconds(one_shot, 200), "one_shot_graph": _graphed(
        one_shot)}
    if rank == 0:
        print("all-reduce µs: " + ", ".join(f"{key} {value:.1f}" for key, value in result.items()), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    disable_multicast()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.start_processes(_rank, args=(port,), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
