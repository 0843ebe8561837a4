"""A tensor-parallel group whose ranks are threads of the test process, for the code that
calls ``torch.distributed.all_reduce`` itself: each rank's call waits for the others, then
every rank gets the MAX or SUM of all, as gloo would give. It lets a unit test run the TP > 1
branch of the loss in one process (so that mutation testing sees it); the 2- and 4-process
tests run the same code over gloo."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import torch
import torch.distributed as dist


class ThreadedGroup:
    """``size`` ranks; :meth:`rank_view` is what rank ``r`` passes as its ``tp_group``."""

    def __init__(self, size: int):
        self._size, self._slots = size, [None] * size
        self._barrier = threading.Barrier(size, timeout=60)
        self.calls: list = []  # (rank, op) of every all-reduce

    def rank_view(self, rank: int) -> "_RankView":
        return _RankView(self, rank)

    def all_reduce(self, tensor, op, rank):
        if op not in (dist.ReduceOp.MAX, dist.ReduceOp.SUM):
            raise ValueError(f"unexpected reduce op {op!r}")
        self.calls.append((rank, op))
        self._slots[rank] = tensor.detach().clone()
        self._barrier.wait()
        stacked = torch.stack(self._slots)
        result = stacked.amax(0) if op == dist.ReduceOp.MAX else stacked.sum(0)
        self._barrier.wait()  # every rank has read the slots
        tensor.copy_(result)


class _RankView:
    def __init__(self, group: ThreadedGroup, rank: int):
        self.group, self._rank = group, rank

    def size(self) -> int:
        return self.group._size

    def rank(self) -> int:
        return self._rank


def _all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    if not isinstance(group, _RankView):
        raise AssertionError(f"all_reduce on {group!r}, not the tensor-parallel group")
    group.group.all_reduce(tensor, op, group.rank())


#: What to put in place of a module's ``dist`` (``torch.distributed``) for these groups.
DIST = SimpleNamespace(
    all_reduce=_all_reduce, ReduceOp=dist.ReduceOp, ProcessGroup=dist.ProcessGroup
)


def run_ranks(size: int, fn):
    """``[fn(rank_view) for each rank]``, the ranks run as threads at once; an exception on
    any rank is raised here."""
    group = ThreadedGroup(size)
    results, errors = [None] * size, []

    def body(rank):
        try:
            results[rank] = fn(group.rank_view(rank))
        except BaseException as exc:  # noqa: B036 - reported to the test below
            errors.append(exc)
            group._barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results, group
