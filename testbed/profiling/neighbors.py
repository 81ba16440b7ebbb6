"""Busy neighbours for `testbed profile --workers N`: N - 1 processes, each a
worker of its own (block manager, sarathi scheduler, KV cache, the profiled
model, `threads` torch threads) stepping a serving-like mix without pause: a
prompt in chunks of 512 tokens beside 8 decodes. While they run, the profile
measures its tables in this process, so that they are the step times of one
of N workers stepping at once on this machine, as a deployment of N real
workers runs near its capacity: a step beside a busy core takes longer than
beside an idle one (shared cache and memory bandwidth; measured in
experiments/README.md, "decision"), which a profile measured
alone does not see."""
from __future__ import annotations

import multiprocessing as mp


def _step_forever(model_name: str, threads: int, ready, stop) -> None:
    import torch

    from testbed.model.config import load_model_preset
    from testbed.profiling.calibration import _timed_steps, decode_service, profiling_service
    from testbed.request import Request
    torch.set_num_threads(threads)
    model = load_model_preset(model_name)
    seq = 0

    def prompt(length: int) -> list[int]:
        nonlocal seq
        seq += 1
        return [(11 * seq + i) % model.vocab_size for i in range(length)]

    chunker, rec = profiling_service(model, num_blocks=1024 // 16 + 8, token_budget=512)
    decoder, drec = decode_service(model, 8, chunker.engine.executor.inner.model, prompt, max_tokens=1 << 30)
    ready.set()
    while not stop.is_set():
        chunker.engine.add_request(Request(f"n{seq}", prompt(1024), max_tokens=1))
        _timed_steps(chunker, rec, 2)
        _timed_steps(decoder, drec, 10)


class Neighbors:
    """`with Neighbors("tiny", 1, threads=1):` one busy neighbour while the
    block runs; stopped and joined when it ends, whatever happens inside."""

    def __init__(self, model_name: str, count: int, threads: int = 1, start_timeout_s: float = 120.0):
        if count < 0:
            raise ValueError(f"--workers: must be >= 1, got {count + 1}")
        self.model_name, self.count, self.threads, self.start_timeout_s = model_name, count, threads, start_timeout_s
        self.procs: list = []

    def __enter__(self) -> "Neighbors":
        ctx = mp.get_context("spawn")
        self._stop = ctx.Event()
        readies = []
        try:
            for _ in range(self.count):
                ready = ctx.Event()
                p = ctx.Process(target=_step_forever, args=(self.model_name, self.threads, ready, self._stop),
                                daemon=True)
                p.start()
                self.procs.append(p)
                readies.append(ready)
            for p, ready in zip(self.procs, readies):
                if not ready.wait(self.start_timeout_s):
                    raise RuntimeError(f"testbed profile --workers: a neighbour (pid {p.pid}) did not start "
                                       f"stepping within {self.start_timeout_s:g} s")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def alive(self) -> int:
        return sum(p.is_alive() for p in self.procs)

    def __exit__(self, *_) -> None:
        self._stop.set()
        for p in self.procs:
            p.join(10.0)
            if p.is_alive():
                p.kill()
                p.join()
        self.procs = []
