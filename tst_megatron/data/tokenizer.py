"""Train a SentencePiece tokenizer with the special ids megatron-core's SentencePiece
tokenizer expects: ``<unk>`` = 0, ``<s>`` = 1, ``</s>`` = 2 (EOD: megatron-core uses the
end-of-sentence id as end of document), ``<pad>`` = 3; byte fallback on, so every UTF-8
string round-trips."""

from __future__ import annotations

import io
import os
from typing import Iterable

import sentencepiece as spm

from tst_megatron.data.files import atomic_path
from tst_megatron.errors import ConfigError

SPECIAL_IDS = {"unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": 3}


def train_tokenizer(
    texts: Iterable[str],
    model_prefix: str,
    *,
    vocab_size: int = 4096,
    model_type: str = "bpe",
    max_sentences: int = 2_000_000,
    seed_sentences: int = 1_000_000,
    character_coverage: float = 1.0,
) -> str:
    """Train on ``texts`` (one document each; lines are SentencePiece "sentences").

    ``character_coverage`` is SentencePiece's option of the same name: the share of the
    text's characters that get pieces of their own; with byte fallback the rest are spelled
    as bytes. Lower it (e.g. 0.9995) when the text has more distinct characters than
    ``vocab_size`` allows.

    Returns the path of the ``.model`` file (``model_prefix + ".model"``; a ``.vocab`` file
    is written beside it).

    Raises:
        ValueError: no text, or SentencePiece rejects the settings (e.g. a vocabulary larger
            than the text supports), with its message.
    """

    def sentences():
        for text in texts:
            for line in text.splitlines():
                if line.strip():
                    yield line

    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentences(),
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            byte_fallback=True,
            character_coverage=character_coverage,
            input_sentence_size=max_sentences,
            shuffle_input_sentence=True,
            seed_sentencepiece_size=seed_sentences,
            max_sentence_length=16384,
            split_digits=True,
            allow_whitespace_only_pieces=True,
            remove_extra_whitespaces=False,
            normalization_rule_name="identity",
            num_threads=os.cpu_count() or 1,
            minloglevel=2,
            **SPECIAL_IDS,
        )
    except RuntimeError as exc:
        raise ConfigError(
            f"SentencePiece training failed: {str(exc).strip().splitlines()[-1]}"
        ) from exc
    path = model_prefix + ".model"
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(model.getvalue())
    processor = spm.SentencePieceProcessor(model_file=path)
    with atomic_path(model_prefix + ".vocab") as tmp, open(tmp, "w", encoding="utf-8") as f:
        for i in range(processor.get_piece_size()):
            f.write(f"{processor.id_to_piece(i)}\t{processor.get_score(i)}\n")
    return path
