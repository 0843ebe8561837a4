"""Local stand-ins for the files the launch scripts read: a SentencePiece model
(``--tokenizer-type Llama2Tokenizer``), GPT-2 BPE ``vocab.json``/``merges.txt``
(``GPT2BPETokenizer``), a Hugging Face tokenizer directory (``HuggingFaceTokenizer``), and a
Megatron ``.bin/.idx`` dataset of Python standard-library sources in each."""

from __future__ import annotations

import json
import os

EOD = "<|endoftext|>"


def _write_dataset(prefix: str, documents: list) -> str:
    """``documents`` (lists of token ids) as megatron-core's indexed dataset at ``prefix``."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for ids in documents:
        builder.add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)])
    builder.finalize(prefix + ".idx")
    return prefix


def build_local_files(root: str, documents: int = 24, chars: int = 4000) -> dict:
    """Tokenizers and datasets under ``root``. Returns ``{name: path}``: ``sp`` (model),
    ``sp_data``, ``vocab``, ``merges``, ``hf`` (directory), ``bpe_data`` (the GPT-2 BPE files
    and the Hugging Face directory share one vocabulary, so one dataset serves both)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    from tst_megatron.data.corpus import build_corpus, jsonl_documents
    from tst_megatron.data.preprocess import preprocess
    from tst_megatron.data.tokenizer import train_tokenizer

    full = os.path.join(root, "stdlib.jsonl")
    build_corpus("python-stdlib", full, max_documents=documents)
    texts = [text[:chars] for text in jsonl_documents(full)]  # the first `chars` of each
    corpus = os.path.join(root, "corpus.jsonl")
    with open(corpus, "w") as f:
        f.writelines(json.dumps({"text": text}) + "\n" for text in texts)
    sp = train_tokenizer(texts, os.path.join(root, "sp"), vocab_size=512)
    sp_data = preprocess(corpus, os.path.join(root, "sp"), sp, append_eod=True)["text"]["prefix"]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=600, special_tokens=[EOD])
    vocab, merges = bpe.save_model(root, "gpt2")
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=EOD)
    fast.save_pretrained(os.path.join(root, "hf"))
    eod = bpe.token_to_id(EOD)
    bpe_data = _write_dataset(
        os.path.join(root, "bpe_text_document"), [bpe.encode(t).ids + [eod] for t in texts]
    )
    return {
        "sp": sp, "sp_data": sp_data, "vocab": vocab, "merges": merges,
        "hf": os.path.join(root, "hf"), "bpe_data": bpe_data,
    }  # fmt: skip
