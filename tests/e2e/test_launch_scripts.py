"""Real Megatron-LM launch scripts pass ``--dry-run`` at their own world size with
only the script name changed, ``--tst-bag-size`` added and paths made local."""

import os

import pytest

from tests.e2e.launch_scripts import SCRIPTS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_launch_script_passes_the_dry_run(name):
    from tests.unit.test_config import _dry

    script = SCRIPTS[name]
    result = _dry(script["argv"], env={"WORLD_SIZE": str(script["world_size"]), "RANK": "0"})
    assert result.returncode == 0, result.stderr
    assert "dry run: no problems found" in result.stdout
    assert f"world {script['world_size']} = " in result.stdout


# --- the same scripts, shrunk to 2 CPU processes, a few steps through the TST switch ---------

# Sizes and parallel sizes reduced; every other flag as in the script, except those a CPU run
# cannot take (CUDA/Transformer Engine features, the nsys profiler range) and W&B (an optional
# package not installed here).
SMALL = {
    "--num-layers": "2", "--hidden-size": "32", "--ffn-hidden-size": "64",
    "--num-attention-heads": "4", "--num-query-groups": "2", "--kv-channels": "8",
    "--seq-length": "16", "--max-position-embeddings": "16", "--num-experts": "4",
    "--moe-ffn-hidden-size": "32", "--moe-router-topk": "2", "--micro-batch-size": "1",
    "--global-batch-size": "4", "--train-iters": "4", "--train-samples": "16",
    "--lr-decay-iters": "4", "--lr-warmup-iters": "1", "--lr-decay-samples": "16",
    "--lr-warmup-samples": "2", "--vocab-size": "128", "--eval-interval": "2",
    "--eval-iters": "1", "--save-interval": "2", "--split": "80,15,5", "--num-workers": "0",
    "--tensor-model-parallel-size": "1", "--context-parallel-size": "1",
}  # fmt: skip
CPU_DROP = {
    "--bf16": 0, "--use-distributed-optimizer": 0, "--overlap-param-gather": 0,
    "--moe-grouped-gemm": 0, "--moe-permute-fusion": 0, "--apply-layernorm-1p": 0,
    "--fp8-param-gather": 0, "--profile": 0, "--fp8-format": 1, "--fp8-amax-history-len": 1,
    "--fp8-amax-compute-algo": 1, "--attention-backend": 1, "--profile-step-start": 1,
    "--profile-step-end": 1, "--wandb-project": 1, "--wandb-exp-name": 1,
}  # fmt: skip
PARALLEL = {  # (PP, EP) at 2 processes
    "mixtral_8x7b": ("2", "1"),
    "llama3_8b_fp8": ("1", "1"),
    "qwen3_30b_a3b": ("1", "2"),
}


def shrink(name: str, paths: dict) -> list:
    """The script's argv for 2 CPU processes (see SMALL, CPU_DROP, PARALLEL)."""
    from tests.e2e import launch_scripts as ls

    pp, ep = PARALLEL[name]
    small = dict(
        SMALL, **{"--pipeline-model-parallel-size": pp, "--expert-model-parallel-size": ep}
    )
    local = {ls.CKPT: paths["ckpt"], ls.TB: paths["tb"], ls.CACHE: paths["cache"]}
    local.update({ls.DATA: paths["data"], ls.SP_MODEL: paths["sp"], ls.HF_DIR: paths["hf"]})
    argv, words = [], list(SCRIPTS[name]["argv"])
    while words:
        word = words.pop(0)
        if word in CPU_DROP:
            del words[: CPU_DROP[word]]
        elif word in small:
            argv += [word, small[word]]
            words.pop(0)
        else:
            argv.append(local.get(word, word.replace(ls.CKPT, paths["ckpt"])))
    return argv + ["--device", "cpu"]


@pytest.fixture(scope="module")
def local_files(tmp_path_factory):
    """A 512-id SentencePiece model, a stdlib dataset in it, and a Hugging Face BPE directory."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    from tst_megatron.data.corpus import build_corpus, jsonl_documents
    from tst_megatron.data.preprocess import preprocess
    from tst_megatron.data.tokenizer import train_tokenizer

    d = tmp_path_factory.mktemp("launch")
    build_corpus("python-stdlib", str(d / "corpus.jsonl"), max_documents=60)
    sp = train_tokenizer(jsonl_documents(str(d / "corpus.jsonl")), str(d / "tok"), vocab_size=512)
    stats = preprocess(str(d / "corpus.jsonl"), str(d / "data"), sp, append_eod=True, workers=2)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(jsonl_documents(str(d / "corpus.jsonl")), vocab_size=600)
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>")
    fast.add_special_tokens({"eos_token": "<|endoftext|>"})
    fast.save_pretrained(str(d / "hf"))
    return {"data": stats["text"]["prefix"], "sp": sp, "hf": str(d / "hf")}


def _train_child(rank, world, *, argv):
    from tst_megatron.training import trainer
    from tst_megatron.training.config import parse_args

    return trainer.train(parse_args(argv))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_launch_script_shrunk_trains_through_the_switch(name, local_files, tmp_path):
    import math

    from tests.distributed.harness import run_distributed

    paths = dict(local_files, ckpt=str(tmp_path / "ckpt"), tb=str(tmp_path / "tb"))
    paths["cache"] = str(tmp_path / "cache")
    histories = run_distributed(_train_child, 2, argv=shrink(name, paths))
    train = histories[0]["train"]
    assert sorted(train) == [1, 2, 3, 4]  # N1 = round(0.3 * 4) = 1: phase 1, then phase 2
    assert all(math.isfinite(v) for v in train.values())
    assert histories[0]["valid"], "validation ran (--eval-interval 2)"
