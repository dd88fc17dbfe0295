"""The processes of a tensor-parallel engine: rank 0 serves (Triton, the scheduler, the perception) and starts
ranks 1..N-1 as child processes (``python -m exporter.runtime.tensor_parallel``); each loads its part of the LLM
and follows rank 0's scheduler steps (`exporter.runtime.cuda_graphs.ForwardStep.follow`) until told to stop.

The group runs over torch.distributed (NCCL between GPUs, rank r on ``cuda:r``; gloo on the CPU) with a second,
gloo, group for rank 0's step messages. NVLink multicast stays off (`exporter.llm.tensor_parallel.MULTICAST_OFF`,
set before the children start). A child dies with rank 0: it reads a pipe from rank 0 and exits when the pipe
closes, however rank 0 ended. A child that fails takes the serving process down (the model cannot run without
it): the others would wait for it forever.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..engine.directory import load_llm_shard, torch_dtype
from ..llm.model import Decoder
from ..llm.tensor_parallel import PeerAllReduce, Shard, TensorParallel, disable_multicast
from .cuda_graphs import ForwardStep

LOGGER = logging.getLogger(__name__)
# A follower waits for rank 0's next step message as long as the server is idle.
_CONTROL_TIMEOUT = datetime.timedelta(days=365)
_GROUP_TIMEOUT = datetime.timedelta(minutes=10)
_WATCH_INTERVAL_S = 0.5
#: All-reduces up to this size (a decode step's, up to 128 rows of a 5120-wide model in bf16) go through
#: `PeerAllReduce`; larger ones (prompt chunks) through NCCL.
PEER_ALL_REDUCE_BYTES = 2 << 20


def rank_device(device: str, rank: int) -> str:
    """Rank ``rank``'s device: ``cuda:<rank>`` when rank 0 serves on CUDA, else ``device``."""
    return f"cuda:{rank}" if torch.device(device).type == "cuda" else device


class Ranks:
    """Rank 0's side of a group: the children it started and its own collectives (``tp``)."""

    def __init__(self, model_dir: Path, size: int, device: str, dtype: str):
        """Start ranks 1..size-1 loading their parts of the engine in ``model_dir``, and join the group."""
        if torch.device(device).type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(f"tensor_parallel_size {size} needs {size} GPUs, this machine has "
                             f"{torch.cuda.device_count()}")
        disable_multicast()
        port = _free_port()
        self._stopping = False
        # the children import this very package, wherever it was imported from
        source = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [source, os.environ.get("PYTHONPATH")]))}
        self.children = [
            subprocess.Popen([sys.executable, "-m", __name__, str(model_dir), "--rank", str(rank), "--size",
                              str(size), "--port", str(port), "--device", rank_device(device, rank), "--dtype",
                              dtype], stdin=subprocess.PIPE, env=env)
            for rank in range(1, size)
        ]
        threading.Thread(target=self._watch, name="tensor-parallel-watch", daemon=True).start()
        self.tp = join(Shard(0, size), port, device, torch_dtype(dtype))
        atexit.register(self.stop)  # after the scheduler's own stop (registered later, run first)

    def stop(self) -> None:
        """Tell the other ranks to stop, wait for them, and leave the group."""
        if self._stopping:
            return
        self._stopping = True
        try:
            self.tp.send(("stop",))
        finally:
            for child in self.children:
                child.stdin.close()
                try:
                    child.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    child.kill()
            dist.destroy_process_group()

    def _watch(self) -> None:
        while not self._stopping:
            for child in self.children:
                code = child.poll()
                if code is not None and not self._stopping:
                    LOGGER.error("tensor-parallel rank process %d exited (status %s); the model cannot run without "
                                 "it: stopping", child.pid, code)
                    logging.shutdown()
                    os._exit(1)
            time.sleep(_WATCH_INTERVAL_S)


def join(shard: Shard, port: int, device: str, dtype: torch.dtype) -> TensorParallel:
    """Join the group on loopback ``port`` as ``shard.rank``: NCCL on CUDA (this rank's GPU current, and the small
    all-reduces of ``dtype`` through symmetric memory where it works), gloo on the CPU; the step messages' gloo
    group beside it."""
    where = torch.device(device)
    cuda = where.type == "cuda"
    if cuda:  # "cuda" (rank 0 serving on the current GPU) named by its index: set_device needs one
        where = torch.device("cuda", torch.cuda.current_device() if where.index is None else where.index)
        torch.cuda.set_device(where)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=shard.rank,
                            world_size=shard.size, timeout=_GROUP_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)
    return TensorParallel(shard, dist.group.WORLD, control,
                          _peer_all_reduce(where, dtype) if cuda else None)


def _peer_all_reduce(device: torch.device, dtype: torch.dtype) -> PeerAllReduce | None:
    """Symmetric-memory all-reduce buffers on every rank, or None (NCCL for all) where any rank cannot have them:
    the ranks agree, so that all take the same path."""
    try:
        peer = PeerAllReduce(dist.group.WORLD, device, dtype, PEER_ALL_REDUCE_BYTES)
        usable = 1
    except Exception as error:  # noqa: BLE001 - an older torch, no peer access: NCCL does it all, slower
        LOGGER.warning("symmetric-memory all-reduce unavailable (%s: %s); NCCL takes every all-reduce",
                       type(error).__name__, error)
        peer, usable = None, 0
    agreed = torch.tensor([usable], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    return peer if int(agreed) else None


def follow(model: Decoder) -> None:
    """A rank other than 0: run rank 0's steps, as its messages say, until it says stop."""
    steps: dict[int, ForwardStep] = {}
    with torch.inference_mode():
        while True:
            message = model.tp.receive()
            if message[0] == "stop":
                return
            if message[0] == "new":
                steps[message[1]] = ForwardStep.follower(model, message[1], message[2])
            elif message[0] == "close":
                del steps[message[1]]
            else:
                steps[message[1]].follow(message)


def _die_with_parent() -> None:
    """Exit as soon as rank 0's pipe (this process's stdin) closes."""
    def wait() -> None:
        sys.stdin.buffer.read()
        os._exit(0)

    threading.Thread(target=wait, name="parent-watch", daemon=True).start()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    """A child rank: load its part of the engine, join the group, follow rank 0."""
    parser = argparse.ArgumentParser(description="one tensor-parallel rank of an engine (started by rank 0)")
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--dtype", required=True)
    args = parser.parse_args(argv)
    _die_with_parent()
    disable_multicast()
    shard = Shard(args.rank, args.size)
    tp = join(shard, args.port, args.device, torch_dtype(args.dtype))
    model = load_llm_shard(args.model_dir, shard, args.device, torch_dtype(args.dtype))
    model.tp = tp
    follow(model)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
