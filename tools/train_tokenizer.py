"""Train a SentencePiece tokenizer (BPE, byte fallback) from a JSONL corpus, with the
special ids megatron-core's SentencePieceTokenizer expects (unk 0, bos 1, eos/EOD 2, pad 3).

    python tools/train_tokenizer.py --input data/stdlib.jsonl --model-prefix data/tok --vocab-size 4096
"""

import argparse
import sys

from tst_megatron.data.corpus import jsonl_documents
from tst_megatron.data.tokenizer import train_tokenizer


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", required=True, help="JSONL corpus")
    p.add_argument("--json-key", default="text")
    p.add_argument("--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--model-type", default="bpe", choices=("bpe", "unigram"))
    p.add_argument(
        "--character-coverage",
        type=float,
        default=1.0,
        help="SentencePiece's share of characters with their own piece (rest: bytes)",
    )
    args = p.parse_args()
    try:
        path = train_tokenizer(
            jsonl_documents(args.input, args.json_key),
            args.model_prefix,
            vocab_size=args.vocab_size,
            model_type=args.model_type,
            character_coverage=args.character_coverage,
        )
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
