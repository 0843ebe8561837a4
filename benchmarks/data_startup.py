"""Start-up costs of the data: the token-id check, and TST's sample orders at scale.

**The token-id check** (the default) on a multi-GB ``.bin`` (one process).
Writes a synthetic dataset of ``--gigabytes`` GB (random ids, ``--dtype``; documents of 1 M
tokens through megatron-core's ``IndexedDatasetBuilder``), then times, side by side:
- *full read*: the check as it was (``numpy`` max over the whole memory-mapped ``.bin``);
- *first start*: :func:`tst_megatron.data.gpt_datasets.check_data_files` with no stamp (reads the
  ``.bin`` once in 16 M-token chunks, min and max, and writes the stamp);
- *second start*: the same call again (the stamp answers; the ``.bin`` is not read).
The page cache is not dropped (other processes share the machine): the reads are warm
after the first, so the read times are lower bounds for a cold disk. The files are deleted
at the end.

    .venv/bin/python benchmarks/data_startup.py --gigabytes 3 --dir /tmp/startup \
        --output docs/results/data_startup.md
    .venv/bin/python benchmarks/data_startup.py --smoke

**TST's sample orders** (``--stream-windows N``): :class:`~tst_megatron.data.stream.TrainStream`
over a synthetic dataset of ``N`` windows (a memory-mapped random permutation of ``N`` as
megatron-core's shuffle index; samples are not read), ``--bag-size S`` and
``--phase1-fraction r`` (phase 1 reads ``r`` of the run's samples, so ``N = X (1 + r (S-1))``
for ``X`` samples). Each start is its own process, as a rank is: the first start (computes
and writes the cache), a second start (maps it) and a start on a second "node" with a cache
directory of its own. For each: seconds to build the stream, the process's peak resident
memory (``VmHWM``, which counts the pages of mapped files it touched) and its peak anonymous
memory (``RssAnon``, sampled every 20 ms: what the rank holds beyond the mapped files), both
also less what the process held before the build (torch and megatron-core imported). The
section "TST sample orders at scale" of ``--output`` is replaced (or added)::

    .venv/bin/python benchmarks/data_startup.py --stream-windows 1113281250 --bag-size 4 \
        --phase1-fraction 0.3 --dir /tmp/stream --output docs/results/data_startup.md
    .venv/bin/python benchmarks/data_startup.py --stream-windows 100000      # a quick check
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
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


class SyntheticWindows:
    """``N`` windows whose megatron-core shuffle index is the memory-mapped ``shuffle.npy``
    (a random permutation of ``N``); sample ``i`` is a one-token stand-in holding ``i``."""

    def __init__(self, directory: str):
        self.shuffle_index = np.load(os.path.join(directory, "shuffle.npy"), mmap_mode="r")
        self.unique_description_hash = f"synthetic-{len(self.shuffle_index)}"

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def __getitem__(self, i: int) -> dict:
        t = torch.tensor([int(i)])
        return {"tokens": t, "labels": t, "loss_mask": torch.ones(1)}


def memory_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def stream_child(directory: str, cache: str, bag_size: int, phase1_samples: int) -> None:
    """One rank's start: builds or maps the stream, prints a JSON line of its costs."""
    from tst_megatron.data.stream import TrainStream

    dataset = SyntheticWindows(directory)
    before_anon, before_hwm = memory_kib("RssAnon"), memory_kib("VmHWM")
    peak, done = [before_anon], threading.Event()

    def sample():
        while not done.wait(0.02):
            peak.append(memory_kib("RssAnon"))

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    start = time.perf_counter()
    stream = TrainStream(
        dataset,
        windows_per_sample=bag_size,
        phase1_samples=phase1_samples,
        seed=1234,
        cache_dir=cache,
    )
    seconds = time.perf_counter() - start
    first, last = stream.phase1_sample(0), stream.phase2_sample(len(stream.phase2) - 1)
    done.set()
    watcher.join()
    peak.append(memory_kib("RssAnon"))
    print(
        json.dumps(
            {
                "seconds": seconds,
                "hwm_gb": memory_kib("VmHWM") / 2**20,
                "hwm_gain_gb": (memory_kib("VmHWM") - before_hwm) / 2**20,
                "anon_gb": max(peak) / 2**20,
                "anon_gain_gb": (max(peak) - before_anon) / 2**20,
                "mapped": isinstance(stream.blocks, np.memmap),
                "samples": [int(first["tokens"][0]), int(last["tokens"][0])],
                "phase2": len(stream.phase2),
            }
        ),
        flush=True,
    )


@contextlib.contextmanager
def work_dir(path):
    """A folder for this benchmark's files, deleted at the end: a fresh temporary one when
    ``path`` is None; else ``path``, which must not exist or be empty (the benchmark deletes
    only what it created there: the folder itself when it made it, else its own files).

    Raises:
        SystemExit: ``path`` holds files (one line; nothing is deleted).
    """
    if path is None:
        path = tempfile.mkdtemp(prefix="tst_data_startup_")
        made = True
    else:
        if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
            sys.exit(f"data_startup.py: --dir {path} is not an empty folder; give a new one")
        made = not os.path.exists(path)
        os.makedirs(path, exist_ok=True)
    try:
        yield path
    finally:
        if made:
            shutil.rmtree(path, ignore_errors=True)
        else:  # an empty folder given: empty again, the folder kept
            for name in os.listdir(path):
                full = os.path.join(path, name)
                shutil.rmtree(full) if os.path.isdir(full) else os.remove(full)


def directory_gb(path: str) -> float:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path)) / 1e9


def replace_section(path: str, title: str, text: str) -> None:
    """``text`` (starting with ``title``) replaces that section of ``path``, or is appended."""
    old = open(path).read() if os.path.exists(path) else ""
    if title in old:
        head, rest = old.split(title, 1)
        after = rest.find("\n# ")
        old = head + (rest[after + 1 :] if after >= 0 else "")
    with open(path + ".tmp", "w") as f:
        f.write(old.rstrip("\n") + ("\n\n" if old.strip() else "") + text)
    os.replace(path + ".tmp", path)


STREAM_TITLE = "# TST sample orders at scale"


def stream_benchmark(args) -> None:
    windows, bag, r = args.stream_windows, args.bag_size, args.phase1_fraction
    samples = int(windows / (1 + r * (bag - 1)))
    phase1 = int(r * samples)
    rows = []
    with work_dir(args.dir) as directory:
        start = time.perf_counter()
        perm = np.arange(windows, dtype=np.uint32 if windows < 2**32 - 1 else np.int64)
        np.random.default_rng(0).shuffle(perm)
        np.save(os.path.join(directory, "shuffle.npy"), perm)
        del perm
        setup_s = time.perf_counter() - start
        node0, node1 = os.path.join(directory, "node0"), os.path.join(directory, "node1")
        starts = [("first start (computes, writes)", node0), ("second start (maps)", node0)]
        if not args.no_second_node:
            starts.append(("a second node's first start (own cache directory)", node1))
        for name, cache in starts:
            os.makedirs(cache, exist_ok=True)
            command = [sys.executable, __file__, "--stream-child", directory, cache]
            command += [str(bag), str(phase1)]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            rows.append((name, json.loads(out.strip().splitlines()[-1])))
        cache_gb = directory_gb(node0)
        index_gb = os.path.getsize(os.path.join(directory, "shuffle.npy")) / 1e9
    assert all(m["samples"] == rows[0][1]["samples"] for _, m in rows)
    lines = [
        STREAM_TITLE,
        "",
        f"{windows:,} windows ({samples:,} samples of which {phase1:,} in phase 1 at "
        f"S = {bag}, r = {r}; phase 2 reads {rows[0][1]['phase2']:,} windows), a synthetic "
        f"megatron-core shuffle index of {index_gb:.2f} GB (written in {setup_s:.0f} s). Each "
        "start is one process, as one rank. Machine: "
        f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
        f"{args.load_note}.",
        "",
        "| start | seconds | peak resident (VmHWM), GiB: total / added by the build | peak "
        "anonymous (beyond mapped files), GiB: total / added by the build | orders mapped |",
        "|---|---|---|---|---|",
        *(
            f"| {name} | {m['seconds']:.2f} | {m['hwm_gb']:.2f} / {m['hwm_gain_gb']:.2f} | "
            f"{m['anon_gb']:.2f} / {m['anon_gain_gb']:.2f} | {'yes' if m['mapped'] else 'no'} |"
            for name, m in rows
        ),
        "",
        f"The cache on disk: {cache_gb:.2f} GB per cache directory (the stream order, 4 bytes "
        "a window; the phase-1 blocks; the phase-2 windows).",
        "",
        f"Command: `.venv/bin/python benchmarks/data_startup.py --stream-windows {windows} "
        f"--bag-size {bag} --phase1-fraction {r}{' --no-second-node' * args.no_second_node}`",
    ]
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    if args.output:
        title = STREAM_TITLE + f" ({windows:,} windows, S = {bag})"
        replace_section(args.output, title, text.replace(STREAM_TITLE, title, 1))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--stream-child":
        directory, cache, bag, phase1 = sys.argv[2:6]
        return stream_child(directory, cache, int(bag), int(phase1))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stream-windows", type=int, help="benchmark TST's sample orders instead")
    p.add_argument("--bag-size", type=int, default=4)
    p.add_argument("--phase1-fraction", type=float, default=0.3)
    p.add_argument("--load-note", default="", help="appended to the machine line")
    p.add_argument(
        "--no-second-node", action="store_true", help="skip the second node's start (a rebuild)"
    )
    p.add_argument("--gigabytes", type=float, default=3.0)
    p.add_argument("--dtype", choices=("uint16", "int32"), default="uint16")
    p.add_argument(
        "--dir",
        help="an empty or new folder for the benchmark's files (default: a fresh temporary one); "
        "a folder holding files is refused",
    )
    p.add_argument("--output")
    p.add_argument("--smoke", action="store_true", help="0.02 GB, for the tests")
    args = p.parse_args()
    if args.stream_windows:
        return stream_benchmark(args)
    from tst_megatron.data.gpt_datasets import check_data_files

    gigabytes = 0.02 if args.smoke else args.gigabytes
    vocab = 32000
    with work_dir(args.dir) as directory:
        prefix = os.path.join(directory, "synthetic_text_document")
        cache = os.path.join(directory, "cache")
        write_s = timed(lambda: write_corpus(prefix, gigabytes, np.dtype(args.dtype).type, vocab))
        size = os.path.getsize(prefix + ".bin")
        full = timed(lambda: int(np.memmap(prefix + ".bin", dtype=args.dtype, mode="r").max()))
        first = timed(lambda: check_data_files(prefix, vocab, cache_path=cache))
        second = timed(lambda: check_data_files(prefix, vocab, cache_path=cache))
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
