"""Write a JSONL corpus ({"text": ...} per document) from a real text source.

python tools/build_corpus.py --source python-stdlib --output data/stdlib.jsonl
python tools/build_corpus.py --source path/to/texts/ --output data/mine.jsonl
python tools/build_corpus.py --source python-stdlib --source python-site-packages \
    --max-bytes 40000000 --output data/code.jsonl   # more text, for longer runs
python tools/build_corpus.py --source system-docs --unique --output data/prose.jsonl  # prose

Named sources (documented in tst_megatron/data/corpus.py): python-stdlib (12.6 MB on
Python 3.11), python-site-packages (the installed packages' .py files, ~180 MB in this
project's .venv), system-docs (/usr/share/doc plain text and changelogs, ~65 MB on Ubuntu).

Under a folder it reads only regular files whose real path stays inside that folder, each of at
most --max-file-bytes (64 MiB); a symlink leaving the folder, a device or FIFO and a larger file
are skipped, each named in a note: line.
"""

import argparse
import sys

from tst_megatron.data.corpus import MAX_FILE_BYTES, SOURCES, build_corpus


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--source",
        action="append",
        default=None,
        help=f"one of {', '.join(SOURCES)}, a directory of text files, or a .jsonl file; "
        "repeat to concatenate sources in order (default: python-stdlib)",
    )
    p.add_argument("--output", required=True, help="JSONL file to write")
    p.add_argument("--max-documents", type=int, default=None, help="stop after this many")
    p.add_argument(
        "--max-bytes", type=int, default=None, help="stop once the text reaches this many bytes"
    )
    p.add_argument(
        "--unique",
        action="store_true",
        help="drop a document whose text repeats an earlier one (e.g. system-docs' licence texts)",
    )
    p.add_argument(
        "--max-file-bytes",
        type=int,
        default=MAX_FILE_BYTES,
        help=f"skip a file larger than this (bytes of text; default {MAX_FILE_BYTES:,})",
    )
    args = p.parse_args()
    sources = args.source or ["python-stdlib"]
    try:
        stats = build_corpus(
            sources,
            args.output,
            max_documents=args.max_documents,
            max_bytes=args.max_bytes,
            unique=args.unique,
            max_file_bytes=args.max_file_bytes,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for path, reason in stats["skipped"][:20]:
        print(f"note: skipped {path}: {reason}", file=sys.stderr)
    if len(stats["skipped"]) > 20:
        print(f"note: skipped {len(stats['skipped']) - 20} more file(s)", file=sys.stderr)
    dropped = f", {stats['duplicates']} repeats dropped" if args.unique else ""
    print(
        f"wrote {stats['documents']} documents ({stats['bytes'] / 1e6:.1f} MB{dropped}) "
        f"to {args.output}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
