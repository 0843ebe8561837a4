"""The cost of checking a cached index array before use (``tst_megatron/data/array_check.py``)
against its size: a ``uint32`` array of ``--windows`` elements (a random permutation, as a
shuffle index or a sample order) written as ``.npy``, then, in order: the record at build time
(:func:`~tst_megatron.data.array_check.summary`, with the array in memory, as it is built), the
check of the memory-mapped file as a start runs it (:func:`~tst_megatron.data.array_check.problem`),
and, for comparison, a full SHA-256 of the file. The page cache is dropped where possible
(root: ``/proc/sys/vm/drop_caches``) before the check, so it reads from disk; the file is
deleted at the end.

    .venv/bin/python benchmarks/cache_check.py --windows 1000000000 --output docs/results/cache_check.md
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import tempfile
import time

import numpy as np

from tst_megatron.data import array_check
from tst_megatron.data.files import atomic_path


def drop_caches() -> bool:
    """Drop the page cache (root only); whether it was dropped."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--windows", type=int, default=10**8)
    p.add_argument("--output")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="tst_cache_check_") as directory:
        path = os.path.join(directory, "order.npy")
        start = time.perf_counter()
        array = np.arange(args.windows, dtype=np.uint32)
        np.random.default_rng(0).shuffle(array)
        made = time.perf_counter() - start
        start = time.perf_counter()
        record = array_check.summary(array)
        summary_s = time.perf_counter() - start
        np.save(path, array)
        del array
        cold = drop_caches()
        start = time.perf_counter()
        mapped = np.load(path, mmap_mode="r")
        assert array_check.problem(mapped, record) is None
        check_s = time.perf_counter() - start
        del mapped
        drop_caches()
        start = time.perf_counter()
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
        full_s = time.perf_counter() - start
        size = os.path.getsize(path)
    lines = [
        "# Checking a cached index array before use",
        "",
        f"A uint32 array of {args.windows:,} elements ({size / 1e9:.2f} GB `.npy`, a random "
        f"permutation made in {made:.1f} s). Machine: {platform.machine()}, {os.cpu_count()} "
        f"CPUs, Python {platform.python_version()}; page cache "
        f"{'dropped before each read (cold disk)' if cold else 'not dropped (not root)'}.",
        "",
        "| step | seconds |",
        "|---|---|",
        f"| record at build time (`summary`: min, max, sampled SHA-256; array in memory) | {summary_s:.3f} |",
        f"| check at start (`problem`: header, range and SHA-256 of {array_check.BLOCKS} blocks of {array_check.BLOCK}) | {check_s:.3f} |",
        f"| for comparison: SHA-256 of the whole file | {full_s:.3f} |",
        "",
        f"Command: `.venv/bin/python benchmarks/cache_check.py --windows {args.windows}`",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output:
        with atomic_path(args.output) as tmp, open(tmp, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
