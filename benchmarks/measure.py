"""Measurement helpers shared by the benchmark scripts."""

from __future__ import annotations

import statistics
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class PeakTensorMemory(TorchDispatchMode):
    """Track the peak of live bytes of tensors created while the mode is active."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen = set()

    def _track(self, tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._seen or storage.nbytes() == 0:
            return
        self._seen.add(key)
        nbytes = storage.nbytes()
        self.live += nbytes
        self.peak = max(self.peak, self.live)

        def release(key=key, nbytes=nbytes):
            self._seen.discard(key)
            self.live -= nbytes

        weakref.finalize(storage, release)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t)
        return out


def measure(fn, repeats):
    """``(median seconds, peak bytes)`` of ``fn()`` (forward + backward)."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    with PeakTensorMemory() as mem:
        fn()
    return statistics.median(times), mem.peak


class CollectiveBytes(TorchDispatchMode):
    """Count the bytes of the tensors passed to torch.distributed collectives (c10d ops)."""

    def __init__(self):
        super().__init__()
        self.bytes = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith("c10d."):
            first = args[0]
            tensors = first if isinstance(first, (list, tuple)) else [first]
            size = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
            self.bytes[name] = self.bytes.get(name, 0) + size
        return func(*args, **(kwargs or {}))
