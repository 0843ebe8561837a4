"""Real text on a GPU machine without network: its own installed Python sources, tokenized with
the tokenizer that travels with the tree (``benchmarks/data/code32k.model``). The GPU check's
real-size rows and the GPU study (``scripts/gpu_study.sh``) train on it.

    python benchmarks/gpu_data.py --output-dir runs/gpu_data [--max-bytes 16000000]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
#: A tokenizer that travels with the tree (SentencePiece BPE, 32,000 pieces, trained on
#: Python's standard library: ``tools/train_tokenizer.py --vocab-size 32000``), for real-text
#: runs on a machine without network.
CARRIED_TOKENIZER = os.path.join(HERE, "data", "code32k.model")


def build_real_text(directory: str, max_bytes: int | None = None, log: str = os.devnull) -> str:
    """A Megatron dataset of real text in ``directory``: the installed packages' ``.py`` files
    (``tools/build_corpus.py --source python-site-packages``, at most ``max_bytes`` of text)
    tokenized with :data:`CARRIED_TOKENIZER` (EOD appended); returns its prefix.

    Raises:
        RuntimeError: a tool exited non-zero (its output is appended to ``log``).
    """
    os.makedirs(directory, exist_ok=True)
    corpus = os.path.join(directory, "corpus.jsonl")
    prefix = os.path.join(directory, "corpus")
    build = ["tools/build_corpus.py", "--source", "python-site-packages", "--output", corpus]
    build += ["--max-bytes", str(max_bytes)] if max_bytes else []
    steps = [
        build,
        ["tools/preprocess_data.py", "--input", corpus, "--output-prefix", prefix,
         "--tokenizer-model", CARRIED_TOKENIZER, "--append-eod",
         "--workers", str(max(1, min(15, (os.cpu_count() or 1) - 1)))],
    ]  # fmt: skip
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    )
    for step in steps:
        result = subprocess.run(
            [sys.executable, *step], cwd=ROOT, env=env, capture_output=True, text=True
        )
        with open(log, "a") as f:
            f.write(f"\n$ {' '.join(step)}\n{result.stdout}{result.stderr}")
        if result.returncode != 0:
            raise RuntimeError(f"{step[0]} exited {result.returncode}; see {log}")
    return prefix + "_text_document"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output-dir", required=True)
    p.add_argument("--max-bytes", type=int, default=None, help="text cap (default: all)")
    args = p.parse_args()
    print(build_real_text(args.output_dir, args.max_bytes, log="/dev/stderr"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
