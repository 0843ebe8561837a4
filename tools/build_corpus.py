"""Write a JSONL corpus ({"text": ...} per document) from a real text source.

python tools/build_corpus.py --source python-stdlib --output data/stdlib.jsonl
python tools/build_corpus.py --source path/to/texts/ --output data/mine.jsonl
"""

import argparse
import sys

from tst_megatron.data.corpus import build_corpus


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--source",
        default="python-stdlib",
        help="python-stdlib, a directory of text files, or a .jsonl file",
    )
    p.add_argument("--output", required=True, help="JSONL file to write")
    p.add_argument("--max-documents", type=int, default=None, help="stop after this many")
    args = p.parse_args()
    try:
        stats = build_corpus(args.source, args.output, max_documents=args.max_documents)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {stats['documents']} documents ({stats['bytes'] / 1e6:.1f} MB) to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
