"""Megatron-LM's --tokenizer-type values through megatron-core's tokenizer classes, compared
with the reference libraries (transformers, sentencepiece) on the same files."""

import pytest

from tst_megatron.errors import ConfigError
from tst_megatron.training.data import build_tokenizer

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

    ours = build_tokenizer("HuggingFaceTokenizer", vocab_size=None, model=str(bpe / "hf"))
    reference = AutoTokenizer.from_pretrained(str(bpe / "hf"))
    assert list(ours.tokenize(TEXT)) == reference.encode(TEXT, add_special_tokens=False)
    assert ours.vocab_size == len(reference)


def test_gpt2_bpe_tokenizer_from_vocab_and_merges(bpe):
    from transformers import GPT2Tokenizer

    ours = build_tokenizer(
        "GPT2BPETokenizer",
        vocab_size=None,
        model=None,
        vocab_file=str(bpe / "vocab.json"),
        merge_file=str(bpe / "merges.txt"),
    )
    reference = GPT2Tokenizer(str(bpe / "vocab.json"), str(bpe / "merges.txt"))
    assert list(ours.tokenize(TEXT)) == reference.encode(TEXT)
    assert ours.eod == reference.convert_tokens_to_ids("<|endoftext|>")


def test_llama2_tokenizer_is_the_sentencepiece_model(tmp_path):
    import sentencepiece as spm

    from tst_megatron.data.tokenizer import train_tokenizer

    model = train_tokenizer(CORPUS * 20, str(tmp_path / "sp"), vocab_size=300)
    ours = build_tokenizer("Llama2Tokenizer", vocab_size=None, model=model)
    reference = spm.SentencePieceProcessor(model_file=model)
    assert list(ours.tokenize(TEXT)) == reference.encode(TEXT)
    assert ours.eod == reference.eos_id()


@pytest.mark.parametrize(
    "kind,kwargs,message",
    [
        ("HuggingFaceTokenizer", {"model": "no/such/dir"}, "--tokenizer-model no/such/dir"),
        ("Llama2Tokenizer", {"model": None}, "--tokenizer-model None does not exist"),
        ("GPT2BPETokenizer", {"model": None}, "--vocab-file None is not a file"),
    ],
)
def test_missing_tokenizer_files_are_named(kind, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        build_tokenizer(kind, vocab_size=None, **kwargs)
