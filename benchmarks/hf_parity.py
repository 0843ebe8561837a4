"""Parity of a trained checkpoint and its Hugging Face export, on real validation text.

    .venv/bin/python benchmarks/hf_parity.py --load runs/quickstart/checkpoints \
        --data-path runs/quickstart/data/stdlib_text_document

Exports the checkpoint (timed), then feeds the same token windows from the end of the
dataset to megatron-core's ``GPTModel`` (1 process, loaded from the checkpoint) and to
``transformers.AutoModelForCausalLM`` (fp32, eager attention), and reports the largest
absolute logit difference, how often the two argmax predictions agree, both models'
next-token losses, and 32 greedy tokens from each. Writes docs/results/hf_parity.md.
"""

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from tst_megatron.quiet import quiet_known_warnings  # noqa: E402

quiet_known_warnings()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--load", required=True, help="checkpoint root (--save) or directory (torch_dist)"
    )
    p.add_argument("--data-path", required=True, help="Megatron dataset prefix (no .bin/.idx)")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--output-dir", default=os.path.join(os.path.dirname(HERE), "docs", "results"))
    args = p.parse_args(argv)

    import transformers
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from benchmarks.measure import write, write_index
    from tst_megatron.conversion import export_checkpoint, mlm
    from tst_megatron.conversion.megatron import (
        build_model,
        read_checkpoint,
        resolve_checkpoint,
        single_process,
    )

    path = resolve_checkpoint(args.load)
    stored, weights = read_checkpoint(path)  # the converter's reader: Megatron-LM's args
    vocab = mlm.vocab_size(stored)
    data = IndexedDataset(args.data_path)
    tokens = torch.from_numpy(data[len(data) - 1].astype("int64"))
    for i in range(len(data) - 2, -1, -1):  # enough text from the last documents
        if tokens.numel() >= args.windows * (args.seq_length + 1):
            break
        tokens = torch.cat([torch.from_numpy(data[i].astype("int64")), tokens])
    windows = tokens[: args.windows * (args.seq_length + 1)].view(args.windows, -1)
    inputs, labels = windows[:, :-1], windows[:, 1:]

    out = tempfile.mkdtemp(prefix="hf_parity_")
    start = time.perf_counter()
    done = export_checkpoint(args.load, os.path.join(out, "hf"))
    export_s = time.perf_counter() - start

    with single_process():
        model = build_model(stored)
        missing, unexpected = model.load_state_dict(weights, strict=False)
        missing = [name for name in missing if not name.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"checkpoint weights do not fit: {missing + unexpected}")

        def megatron_logits(ids):
            positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
            with torch.no_grad():
                return model(ids, positions, None)[..., :vocab].double()

        ours = megatron_logits(inputs)
        greedy_ours = inputs[:1, :16]
        for _ in range(32):
            next_id = megatron_logits(greedy_ours)[:, -1].argmax(-1, keepdim=True)
            greedy_ours = torch.cat([greedy_ours, next_id], dim=1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.join(out, "hf"), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        theirs = hf(inputs).logits.double()
        greedy_theirs = hf.generate(
            inputs[:1, :16], max_new_tokens=32, do_sample=False, pad_token_id=0
        )
    shutil.rmtree(out)

    def loss(logits):
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, vocab), labels.reshape(-1)
        ).item()

    diff = (ours - theirs).abs().max().item()
    agree = (ours.argmax(-1) == theirs.argmax(-1)).double().mean().item()
    same_greedy = greedy_ours.tolist() == greedy_theirs.tolist()
    lines = [
        "# Hugging Face export parity (`benchmarks/hf_parity.py`)",
        "",
        f"Checkpoint `{done['checkpoint']}` exported as {done['architecture']} "
        f"({done['tensors']} tensors, {done['dtype']}) in {export_s:.1f} s; "
        f"{args.windows} windows of {args.seq_length} tokens from the end of `{args.data_path}`.",
        "",
        "| | value |",
        "| --- | --- |",
        f"| max abs logit difference (megatron-core vs transformers, fp32) | {diff:.2e} |",
        f"| argmax agreement | {100 * agree:.2f}% |",
        f"| next-token loss, megatron-core | {loss(ours):.6f} |",
        f"| next-token loss, transformers | {loss(theirs):.6f} |",
        f"| 32 greedy tokens identical | {'yes' if same_greedy else 'NO'} |",
        "",
        f"Command: `python benchmarks/hf_parity.py {' '.join(argv or sys.argv[1:])}`  ",
        f"Machine: {platform.platform()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"transformers {transformers.__version__}.",
        "",
    ]
    os.makedirs(args.output_dir, exist_ok=True)
    write(os.path.join(args.output_dir, "hf_parity.md"), "\n".join(lines))
    write_index(args.output_dir)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
