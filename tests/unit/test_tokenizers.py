"""Megatron-LM's --tokenizer-type values as the launcher gets them (megatron-core's
``build_tokenizer`` on Megatron-LM's parsed arguments), compared with the reference libraries
(transformers, sentencepiece) on the same files (megatron-core 0.19's ``GPT2BPETokenizer``
loads the hub name ``gpt2`` whatever the files: it needs network access, so it is not tested
here); a missing tokenizer file is refused before
any work (``tokenizer_problems``)."""

import argparse

import pytest

from tests.unit.test_data_boundary import megatron_tokenizer
from tst_megatron.training.checks.data import tokenizer_problems

TEXT = "def main(argv):\n    return sum(int(a) for a in argv)  # tokenizers, tokens\n"
CORPUS = [TEXT * 3, "import os\nprint(os.getcwd())\n" * 5, "the quick brown fox " * 20]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A byte-level BPE trained here: GPT-2 style vocab.json/merges.txt and an HF directory."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("bpe")
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(CORPUS, vocab_size=300, special_tokens=["<|endoftext|>"])
    tok.save_model(str(d))  # vocab.json, merges.txt
    fast = PreTrainedTokenizerFast(tokenizer_object=tok._tokenizer, eos_token="<|endoftext|>")
    fast.save_pretrained(str(d / "hf"))
    return d


def test_huggingface_tokenizer_reads_a_local_directory(bpe):
    from transformers import AutoTokenizer

    ours = megatron_tokenizer(
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(bpe / "hf")
    )
    reference = AutoTokenizer.from_pretrained(str(bpe / "hf"))
    assert list(ours.tokenize(TEXT)) == reference.encode(TEXT, add_special_tokens=False)
    assert ours.vocab_size == len(reference)


def test_llama2_tokenizer_is_the_sentencepiece_model(tmp_path):
    import sentencepiece as spm

    from tst_megatron.data.tokenizer import train_tokenizer

    model = train_tokenizer(CORPUS * 20, str(tmp_path / "sp"), vocab_size=300)
    ours = megatron_tokenizer("--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", model)
    reference = spm.SentencePieceProcessor(model_file=model)
    assert list(ours.tokenize(TEXT)) == reference.encode(TEXT)
    assert ours.eod == reference.eos_id()


@pytest.mark.parametrize(
    "kind,files,message",
    [
        ("Llama2Tokenizer", {"tokenizer_model": None}, "--tokenizer-model None is not a file"),
        ("SentencePieceTokenizer", {"tokenizer_model": "no/such"}, "--tokenizer-model no/such"),
        ("GPT2BPETokenizer", {"vocab_file": None}, "--vocab-file None is not a file"),
    ],
)
def test_missing_tokenizer_settings_are_named(kind, files, message):
    args = argparse.Namespace(
        tokenizer_type=kind, tokenizer_model=None, vocab_file=None, merge_file=None
    )
    for key, value in files.items():
        setattr(args, key, value)
    (line, *_) = tokenizer_problems(args, launch=True)
    assert message in line
    hub = argparse.Namespace(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="org/name")
    assert tokenizer_problems(hub, launch=True) == []  # a hub name is not a file


def test_wandb_without_the_package_is_refused_in_a_launch_only():
    """Megatron-LM imports wandb in set_global_variables (a traceback on the last rank); the
    dry run may run where the cluster's packages are not, so it does not ask."""
    import importlib.util

    from tests.unit.test_dry_run import SMALL, dry
    from tst_megatron.training.checks.hardware import installed_problems

    args = argparse.Namespace(
        tokenizer_type="NullTokenizer", vocab_size=128, wandb_project="p", wandb_exp_name="e"
    )
    installed = importlib.util.find_spec("wandb") is not None
    expected = (
        [] if installed else ["--wandb-project needs the wandb package here: pip install wandb"]
    )
    assert installed_problems(args) == expected
    assert tokenizer_problems(args, launch=True) == tokenizer_problems(args, launch=False) == []
    # a dry run does not ask (the cluster may have the package)
    wandb = ["--wandb-project", "p", "--wandb-exp-name", "e", "--device", "cpu"]
    assert dry([*SMALL, *wandb], env={"WORLD_SIZE": "1"}).returncode == 0
