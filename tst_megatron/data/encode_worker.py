"""The tokenizing worker of :func:`tst_megatron.data.preprocess.preprocess`: imports only
``json``, numpy and SentencePiece, so a spawned worker starts in a fraction of a second (the
preprocessing module itself imports torch and megatron-core)."""

from __future__ import annotations

import json
from typing import Optional

import numpy as np
import sentencepiece as spm

_processor: Optional[spm.SentencePieceProcessor] = None


def init_worker(model: str) -> None:
    """Load the SentencePiece ``model`` once per worker process."""
    global _processor
    _processor = spm.SentencePieceProcessor(model_file=model)


def encode(args) -> dict:
    """``(json line, keys, append_eod) -> {key: ids}``: each key's text tokenized into an
    int32 array (a pickled array is far cheaper to hand back than a list of ints), with the
    EOD (SentencePiece's ``</s>``, megatron-core's SentencePiece EOD) appended to a non-empty
    document when ``append_eod``; a missing or empty text gives an empty array."""
    line, keys, append_eod = args
    document = json.loads(line)
    out = {}
    for key in keys:
        ids = _processor.encode(document[key]) if document.get(key) else []
        if ids and append_eod:
            ids.append(_processor.eos_id())
        out[key] = np.asarray(ids, dtype=np.int32)
    return out
