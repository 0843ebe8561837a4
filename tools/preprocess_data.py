"""JSONL -> Megatron .bin/.idx (Megatron-LM's tools/preprocess_data.py flags).

    python tools/preprocess_data.py --input data/stdlib.jsonl --output-prefix data/stdlib \
        --tokenizer-type SentencePieceTokenizer --tokenizer-model data/tok.model --append-eod
"""

import argparse
import sys


def main() -> int:
    # imported here: each spawned worker re-imports this script, and needs no torch
    from tst_megatron.data.preprocess import preprocess

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", required=True)
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--output-prefix", required=True)
    p.add_argument(
        "--tokenizer-type", default="SentencePieceTokenizer", choices=("SentencePieceTokenizer",)
    )
    p.add_argument("--tokenizer-model", required=True)
    p.add_argument("--append-eod", action="store_true")
    p.add_argument("--workers", type=int, default=1)
    args = p.parse_args()
    try:
        stats = preprocess(
            args.input,
            args.output_prefix,
            args.tokenizer_model,
            json_keys=args.json_keys,
            append_eod=args.append_eod,
            workers=args.workers,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for key, s in stats.items():
        print(f"{key}: {s['documents']} documents, {s['tokens']} tokens -> {s['prefix']}.bin/.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
