"""``tools/preprocess_data.py`` side by side with Megatron-LM 0.19's own
``tools/preprocess_data.py`` on the same JSONL: wall time (documents and MB per second) and
the peak resident memory of the reading process (``ru_maxrss`` of the tool's main process;
its encoding workers hold one document at a time), at two input sizes for ours, to show its
memory is flat in the input's size.

The JSONL repeats the ``python-stdlib`` corpus (``tools/build_corpus.py``) up to each size;
the tokenizer is the carried 32k SentencePiece model (``benchmarks/data/code32k.model``).
Megatron-LM's tool is not in the megatron-core wheel: pass its file (e.g. ``git show
core_v0.19.0:tools/preprocess_data.py`` from a Megatron-LM clone).

    .venv/bin/python benchmarks/preprocess_compare.py --sizes-mb 100,400 --workers 2 \\
        --megatron-lm-tool /tmp/mlm_preprocess_data.py --output docs/results/preprocess.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

from tst_megatron.data.files import atomic_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "benchmarks", "data", "code32k.model")

#: Runs a tool as its own ``__main__`` and prints the process's peak RSS (KiB) last.
WRAPPER = (
    "import resource, runpy, sys; sys.argv = sys.argv[1:]; "
    "code = 0\n"
    "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
    "except SystemExit as e:\n    code = e.code or 0\n"
    "print('PEAK_KIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)\n"
    "sys.exit(code)"
)


def make_jsonl(path: str, megabytes: int) -> int:
    """A JSONL of the stdlib corpus repeated to ``megabytes`` MB; returns its documents."""
    from tst_megatron.data.corpus import documents

    texts = [t for t in documents("python-stdlib") if t.strip()]
    target, size, count = megabytes * 10**6, 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while size < target:
            for text in texts:
                line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
                f.write(line)
                size += len(line.encode("utf-8"))
                count += 1
                if size >= target:
                    break
    return count


def run(tool: str, argv: list[str]) -> tuple[float, int]:
    """``(seconds, peak KiB of the tool's main process)``."""
    command = [sys.executable, "-c", WRAPPER, tool, *argv]
    start = time.perf_counter()
    out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - start
    if out.returncode != 0:
        raise SystemExit(f"{tool} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    peak = [line for line in out.stdout.splitlines() if line.startswith("PEAK_KIB")][-1]
    return seconds, int(peak.split()[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mb", default="100,400")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--megatron-lm-tool", help="Megatron-LM 0.19's tools/preprocess_data.py")
    p.add_argument("--output")
    args = p.parse_args()
    sizes = [int(x) for x in args.sizes_mb.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="tst_preprocess_") as work:
        for mb in sizes:
            jsonl = os.path.join(work, f"in{mb}.jsonl")
            docs = make_jsonl(jsonl, mb)
            common = ["--input", jsonl, "--tokenizer-type", "SentencePieceTokenizer"]
            common += ["--tokenizer-model", MODEL, "--workers", str(args.workers), "--append-eod"]
            ours = os.path.join(ROOT, "tools", "preprocess_data.py")
            seconds, peak = run(ours, common + ["--output-prefix", os.path.join(work, f"o{mb}")])
            rows.append(("tst_megatron tools/preprocess_data.py", mb, docs, seconds, peak))
            if args.megatron_lm_tool and mb == sizes[0]:
                out = ["--output-prefix", os.path.join(work, f"m{mb}")]
                seconds, peak = run(args.megatron_lm_tool, common + out)
                rows.append(("Megatron-LM 0.19 tools/preprocess_data.py", mb, docs, seconds, peak))
            os.remove(jsonl)
            for name in os.listdir(work):
                os.remove(os.path.join(work, name))
    lines = [
        "# Preprocessing: memory against input size, and throughput against Megatron-LM's tool",
        "",
        f"The stdlib corpus repeated to each size as JSONL, the carried 32k SentencePiece model, "
        f"--workers {args.workers}, --append-eod. Machine: {platform.machine()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}. Peak memory: `ru_maxrss` of "
        "the tool's main process (the one that reads the input).",
        "",
        "| tool | input MB | documents | seconds | MB/s | peak MiB |",
        "|---|---|---|---|---|---|",
        *(
            f"| {tool} | {mb} | {docs:,} | {s:.1f} | {mb / s:.2f} | {kib / 1024:.0f} |"
            for tool, mb, docs, s, kib in rows
        ),
        "",
        f"Command: `.venv/bin/python benchmarks/preprocess_compare.py --sizes-mb {args.sizes_mb} "
        f"--workers {args.workers} --megatron-lm-tool <Megatron-LM core_v0.19.0 "
        "tools/preprocess_data.py>`",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output:
        with atomic_path(args.output) as tmp, open(tmp, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
