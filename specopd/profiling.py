"""Phase spans per worker (the ray owner extends this: NVML sampling, trace.json, timeline.png)."""
from __future__ import annotations

import contextlib
import time


class Profiler:
    def __init__(self, worker: str = "worker0", sync_cuda: bool = True):
        self.worker = worker
        self.sync_cuda = sync_cuda
        self.events: list = []  # (worker, name, start_s, end_s)

    def _sync(self):
        if self.sync_cuda:
            import torch

            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()

    @contextlib.contextmanager
    def span(self, name: str):
        self._sync()
        t0 = time.time()
        try:
            yield
        finally:
            self._sync()
            self.events.append((self.worker, name, t0, time.time()))
