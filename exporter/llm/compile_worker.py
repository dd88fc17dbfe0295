"""The compile worker processes of `parallel_compile.compiles_only`: each runs this module
(`python -m exporter.llm.compile_worker`), and `WorkerPool` in the parent starts them and hands them jobs.

A worker imports what a compile needs, then reads jobs from stdin until its end: each a length-prefixed pickle
(`parallel_compile._payload`) of one Triton compile, run into Triton's disk cache; for each it writes a
length-prefixed pickle to stdout: `(True, seconds)`, or `(False, the error's text)`. A plain process of this module,
not a `multiprocessing` child: the parent's main script is never imported again here.
"""

from __future__ import annotations

import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
import time
import traceback
from typing import BinaryIO

import triton.compiler

LENGTH = struct.Struct("<Q")  # the length prefix of each message, both ways
STOP_WAIT_S = 2.0  # how long `WorkerPool.stop` waits for the workers to exit once their stdin is closed


def read_message(stream: BinaryIO) -> bytes | None:
    """The next length-prefixed message on `stream`; None at its end (EOFError where it ends inside one)."""
    head = stream.read(LENGTH.size)
    if not head:
        return None
    size = LENGTH.unpack(head)[0] if len(head) == LENGTH.size else -1
    body = stream.read(size) if size >= 0 else b""
    if len(body) != size:
        raise EOFError("the stream ended inside a message")
    return body


def write_message(stream: BinaryIO, body: bytes) -> None:
    """Write `body` length-prefixed to `stream`, flushed."""
    stream.write(LENGTH.pack(len(body)) + body)
    stream.flush()


def compile_job(payload: bytes) -> float:
    """Run the compile `payload` into Triton's disk cache; returns its seconds."""
    started = time.perf_counter()
    cache_dir, fn, signature, constexprs, attrs, target, options, env_vars = pickle.loads(payload)
    os.environ["TRITON_CACHE_DIR"] = cache_dir  # the parent's, wherever it was when this process started
    source = triton.compiler.ASTSource(fn, signature, constexprs, attrs)
    triton.compiler.compile(source, target=target, options=options, _env_vars=env_vars)
    return time.perf_counter() - started


class WorkerPool:
    """`size` worker processes, started in the background (with the parent's environment and `sys.path`, so that
    the modules of its kernels import there as here); `run`, called from the caller's threads, hands a job to a
    free one and waits for it. A worker that exits or breaks its pipe is dropped, its job failing (the caller
    compiles it)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.idle: queue.SimpleQueue[subprocess.Popen | None] = queue.SimpleQueue()  # None: no worker is left
        self.processes: list[subprocess.Popen] = []
        self.alive = size
        self.stopped = False
        self.lock = threading.Lock()
        self.starter = threading.Thread(target=self._start, name="triton-compile-workers-start", daemon=True)
        self.starter.start()

    def _start(self) -> None:
        command = [sys.executable, "-m", __name__]
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join(path or os.getcwd() for path in sys.path)}
        for _ in range(self.size):
            with self.lock:
                if self.stopped:
                    return
                try:
                    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                               env=environment)
                except OSError:
                    self._lost_one()
                    continue
                self.processes.append(process)
            self.idle.put(process)

    def _lost_one(self) -> None:
        """Count a worker lost (the lock held); with none left, jobs fail at once."""
        self.alive -= 1
        if self.alive == 0:
            self.idle.put(None)

    def run(self, payload: bytes) -> float:
        """Run the compile `payload` in a free worker (waiting for one) and return its seconds; RuntimeError where
        it failed there, where its worker was lost, or where none is left."""
        process = self.idle.get()
        if process is None:
            self.idle.put(None)
            raise RuntimeError("no compile worker process is left")
        try:
            write_message(process.stdin, payload)
            answer = read_message(process.stdout)
        except (OSError, ValueError, EOFError):  # a broken pipe, a closed one, a message cut short
            answer = None
        if answer is None:
            process.kill()
            with self.lock:
                self._lost_one()
            raise RuntimeError(f"compile worker process {process.pid} exited")
        self.idle.put(process)
        done, value = pickle.loads(answer)
        if not done:
            raise RuntimeError(value)
        return value

    def stop(self) -> None:
        """Close the workers' stdin and wait `STOP_WAIT_S` at most for them to exit, killing those left; a `run`
        waiting for a worker then fails at once."""
        with self.lock:
            self.stopped = True
        self.idle.put(None)
        self.starter.join()
        for process in self.processes:
            try:
                process.stdin.close()
            except OSError:
                pass
        deadline = time.monotonic() + STOP_WAIT_S
        for process in self.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            process.stdout.close()


def main() -> None:
    """Serve jobs from stdin until its end; stdout carries only the results (anything printed goes to stderr)."""
    results = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    import torch  # noqa: F401 - what the kernels' modules import, before the first job

    import exporter.llm.parallel_compile  # noqa: F401 - a job's kernels are unpickled through it

    jobs = sys.stdin.buffer
    while (payload := read_message(jobs)) is not None:
        try:
            result: tuple[bool, float | str] = (True, compile_job(payload))
        except Exception:  # noqa: BLE001 - the parent compiles it itself and meets the error there
            result = (False, traceback.format_exc(limit=3))
        write_message(results, pickle.dumps(result))


if __name__ == "__main__":
    main()
