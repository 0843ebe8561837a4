"""Greedy generation with plain Hugging Face transformers from an exported checkpoint.

    python examples/generate_hf.py runs/quickstart/hf --prompt "def main(" --max-new-tokens 32

The directory comes from ``tools/convert_checkpoint.py export``: no tst_megatron code is
involved here, which is the point: a TST-trained model is an ordinary causal LM.
"""

import argparse
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="Hugging Face model directory")
    p.add_argument("--prompt", default="def main(")
    p.add_argument("--max-new-tokens", type=int, default=32)
    args = p.parse_args(argv)
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model).eval()
    inputs = tokenizer(args.prompt, return_tensors="pt", add_special_tokens=False)
    output = model.generate(
        **inputs,
        max_new_tokens=args.max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
    )
    print(tokenizer.decode(output[0], skip_special_tokens=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
