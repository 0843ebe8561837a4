"""Convert checkpoints between Megatron torch_dist and Hugging Face.

    # Megatron checkpoint (any TP/PP/VPP/EP layout) -> Hugging Face directory
    python tools/convert_checkpoint.py export --load runs/quickstart/checkpoints --save hf/quickstart
    # Hugging Face directory -> weights-only torch_dist checkpoint for --load (any layout)
    python tools/convert_checkpoint.py import --load hf/Qwen3-30B-A3B --save ckpt/qwen3-moe

export reads checkpoints of Megatron-LM's own loop (examples/pretrain_gpt_tst.py, or any
megatron.training.pretrain() run: the model is built from the Megatron-LM ``args`` the
checkpoint stores, as the launcher builds it). Checkpoints of the former hand-written trainer
are no longer read (the converter of commit 0dc9f79 reads them). import writes Megatron-LM's
``release`` layout (tracker file, ``args`` namespace, iteration 0), which ``--load`` reads as
weights only: iteration 0, a new optimizer, no RNG state.

The target architecture is chosen from the model's settings: Qwen3-MoE (experts and
--qk-layernorm), Mixtral (experts), Qwen3 (--qk-layernorm) or Llama. Runs in one process on
the CPU. Neither ever replaces a checkpoint, its own input, or a folder holding either;
--force replaces only a previous export (import) of this tool (tst_megatron/conversion/output.py).
"""

import argparse
import signal
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    sub = p.add_subparsers(dest="direction", required=True)
    e = sub.add_parser("export", help="Megatron torch_dist -> Hugging Face")
    e.add_argument(
        "--load",
        required=True,
        help="a --save root (its latest checkpoint) or one checkpoint directory",
    )
    e.add_argument(
        "--ckpt-step",
        type=int,
        default=None,
        help="export iter_<N> of the --load root instead of the latest",
    )
    e.add_argument("--save", required=True, help="Hugging Face directory to create")
    e.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="tensor dtype (auto: as imported, else the parameter dtype)",
    )
    e.add_argument(
        "--tokenizer-model",
        default=None,
        help="SentencePiece model to include (default: the run's, if it exists)",
    )
    e.add_argument("--max-shard-size", default="5GB", help="safetensors shard limit (default 5GB)")
    e.add_argument(
        "--force", action="store_true", help="replace a previous export at --save (nothing else)"
    )
    e.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="read --load's pickles without the restricted unpickler that refuses any global "
        "a Megatron-LM checkpoint does not hold; such a pickle can run any code: only for "
        "checkpoints you made yourself",
    )
    i = sub.add_parser("import", help="Hugging Face -> Megatron torch_dist (release)")
    i.add_argument("--load", required=True, help="Hugging Face model directory")
    i.add_argument("--save", required=True, help="checkpoint root to create (for --load)")
    i.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="vocabulary padding, as Megatron-LM's flag (default 128)",
    )
    i.add_argument(
        "--tensor-model-parallel-size",
        type=int,
        default=1,
        help="the TP of the runs that will load it (vocabulary padding only)",
    )
    i.add_argument(
        "--force", action="store_true", help="replace a previous import at --save (nothing else)"
    )
    args = p.parse_args(argv)
    # a SIGTERM (Slurm, kill) unwinds like an error: the conversion's temporary folder is removed
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    from tst_megatron.quiet import quiet_known_warnings

    quiet_known_warnings()
    from tst_megatron.conversion import export_checkpoint, import_checkpoint

    try:
        if args.direction == "export":
            done = export_checkpoint(
                args.load,
                args.save,
                ckpt_step=args.ckpt_step,
                dtype=args.dtype,
                tokenizer_model=args.tokenizer_model,
                max_shard_size=args.max_shard_size,
                force=args.force,
                trust=args.trust_checkpoint,
            )
            print(
                f"exported {done['checkpoint']} as {done['architecture']} "
                f"({done['tensors']} tensors, {done['dtype']}) to {done['out']}"
            )
            if done["phase1"] is not None:
                iteration, n1 = done["phase1"]
                print(
                    f"note: iteration {iteration} is in TST phase 1 (the switch is at "
                    f"{n1}): this model was trained on bags only and is no usable next-token "
                    "model yet; export a checkpoint from the switch on"
                )
            if done["tokenizer"] is None:
                print(
                    "note: no tokenizer included (the run's is unknown or missing); "
                    "pass --tokenizer-model to add one"
                )
        else:
            done = import_checkpoint(
                args.load,
                args.save,
                make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                tensor_model_parallel_size=args.tensor_model_parallel_size,
                force=args.force,
            )
            print(
                f"imported {args.load} ({done['architecture']}) to {done['checkpoint']}"
                + (f", tokenizer {done['tokenizer']}" if done["tokenizer"] else "")
            )
            print("train from it with: --load " + args.save + " " + " ".join(done["flags"]))
            print(
                "note: a release checkpoint loads as weights only (iteration 0, a new optimizer "
                "and RNG state; no --finetune, --no-load-optim or --no-load-rng needed); pass "
                "the same --make-vocab-size-divisible-by and a --tensor-model-parallel-size "
                "whose padding gives the same vocabulary rows"
            )
    except (ValueError, FileExistsError, FileNotFoundError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
