"""Start-up cost of the token-id check on a multi-GB ``.bin`` (one process).

Writes a synthetic dataset of ``--gigabytes`` GB (random ids, ``--dtype``; documents of 1 M
tokens through megatron-core's ``IndexedDatasetBuilder``), then times, side by side:
- *full read*: the check as it was (``numpy`` max over the whole memory-mapped ``.bin``);
- *first start*: :func:`tst_megatron.training.data.check_data_files` with no stamp (reads the
  ``.bin`` once in 16 M-token chunks, min and max, and writes the stamp);
- *second start*: the same call again (the stamp answers; the ``.bin`` is not read).
The page cache is not dropped (other processes share the machine): the reads are warm
after the first, so the read times are lower bounds for a cold disk. The files are deleted
at the end.

    .venv/bin/python benchmarks/data_startup.py --gigabytes 3 --dir /tmp/startup \
        --output docs/results/data_startup.md
    .venv/bin/python benchmarks/data_startup.py --smoke
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import time

import numpy as np
import torch


def write_corpus(prefix: str, gigabytes: float, dtype, vocab: int) -> int:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    doc = 1 << 20
    n_docs = max(1, int(gigabytes * 1e9 / np.dtype(dtype).itemsize / doc))
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for _ in range(n_docs):
        builder.add_document(torch.from_numpy(rng.integers(0, vocab, doc, dtype=np.int64)), [doc])
    builder.finalize(prefix + ".idx")
    return n_docs * doc


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gigabytes", type=float, default=3.0)
    p.add_argument("--dtype", choices=("uint16", "int32"), default="uint16")
    p.add_argument("--dir", default="/tmp/tst_data_startup")
    p.add_argument("--output")
    p.add_argument("--smoke", action="store_true", help="0.02 GB, for the tests")
    args = p.parse_args()
    from tst_megatron.training.data import check_data_files

    gigabytes = 0.02 if args.smoke else args.gigabytes
    vocab = 32000
    os.makedirs(args.dir, exist_ok=True)
    prefix = os.path.join(args.dir, "synthetic_text_document")
    cache = os.path.join(args.dir, "cache")
    try:
        write_s = timed(lambda: write_corpus(prefix, gigabytes, np.dtype(args.dtype).type, vocab))
        size = os.path.getsize(prefix + ".bin")
        full = timed(lambda: int(np.memmap(prefix + ".bin", dtype=args.dtype, mode="r").max()))
        first = timed(lambda: check_data_files(prefix, vocab, cache_path=cache))
        second = timed(lambda: check_data_files(prefix, vocab, cache_path=cache))
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    rows = [
        ("full read (the check before)", full),
        ("first start (read once, write the stamp)", first),
        ("second start (stamp)", second),
    ]
    lines = [
        "# Start-up cost of the token-id check",
        "",
        f"`.bin` of {size / 1e9:.2f} GB ({args.dtype}, {size // np.dtype(args.dtype).itemsize:,} "
        f"tokens; written in {write_s:.1f} s), one process, page cache warm. Machine: "
        f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}.",
        "",
        "| start | seconds | vs full read |",
        "|---|---|---|",
        *(f"| {name} | {t:.4f} | {t / full:.4f}x |" for name, t in rows),
        "",
        f"Command: `.venv/bin/python benchmarks/data_startup.py --gigabytes {gigabytes:g} "
        f"--dtype {args.dtype}`",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
