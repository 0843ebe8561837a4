"""JSONL -> Megatron ``.bin/.idx`` through megatron-core's ``IndexedDatasetBuilder``, with
Megatron-LM's output names (``<prefix>_<key>_document.bin/.idx``) and dtype choice
(``DType.optimal_dtype``: uint16 for vocabularies under 65500 ids, else int32)."""

from __future__ import annotations

import itertools
import multiprocessing
import os
from typing import Sequence

import numpy as np
import sentencepiece as spm
import torch
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

from tst_megatron.data import encode_worker
from tst_megatron.data.files import write_stamp
from tst_megatron.progress import progress

#: Documents handed to each worker per round: memory holds at most one round of documents
#: (``Pool.imap`` alone queues the whole input ahead of the workers).
BATCH_PER_WORKER = 256


def _bounded_imap(pool, tasks, batch: int):
    """``pool.imap(_encode, tasks)`` in order, ``batch`` tasks at a time, so the input is read
    as it is encoded: memory stays flat in the input's size."""
    while chunk := list(itertools.islice(tasks, batch)):
        yield from pool.imap(encode_worker.encode, chunk, chunksize=16)


def output_paths(prefix: str, key: str) -> tuple[str, str]:
    """Megatron-LM's names: ``<prefix>_<key>_document.bin`` and ``.idx``."""
    base = f"{prefix}_{key}_document"
    return base + ".bin", base + ".idx"


def preprocess(
    input_path: str,
    output_prefix: str,
    tokenizer_model: str,
    *,
    json_keys: Sequence[str] = ("text",),
    append_eod: bool = True,
    workers: int = 1,
) -> dict:
    """Tokenize every document of ``input_path`` and write one dataset per JSON key.

    The input is read as it is encoded (a round of documents per worker at a time,
    :data:`BATCH_PER_WORKER`): memory stays flat in its size, as Megatron-LM's own
    ``tools/preprocess_data.py`` streams its input.

    Files are written under temporary names and renamed at the end, ``.bin`` before
    ``.idx``, so an ``.idx`` file means its dataset is complete. The range of token ids
    written and the occurrences of the tokenizer's pad id are recorded beside them
    (``<prefix>.token-range.json``, :func:`tst_megatron.data.files.write_stamp`), so the
    launcher's start-up check of the ids does not read the ``.bin``.

    Returns ``{key: {"documents": n, "tokens": m, "prefix": dataset prefix}}``.

    Raises:
        ValueError: missing input/tokenizer, or no document with text (nothing is written).
    """
    for path, what in ((input_path, "input"), (tokenizer_model, "tokenizer model")):
        if not os.path.isfile(path):
            raise ValueError(f"{what} {path} does not exist")
    processor = spm.SentencePieceProcessor(model_file=tokenizer_model)
    vocab, pad = processor.get_piece_size(), processor.pad_id()  # pad -1: none
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    final = {key: output_paths(output_prefix, key) for key in json_keys}
    tmp = {key: tuple(f"{p}.tmp{os.getpid()}" for p in final[key]) for key in json_keys}
    stats = {key: {"documents": 0, "tokens": 0, "prefix": final[key][0][:-4]} for key in json_keys}
    ranges = {}  # key -> (min id, max id) written
    pads = dict.fromkeys(json_keys, 0)  # key -> occurrences of the pad id written
    try:
        builders = {
            key: IndexedDatasetBuilder(tmp[key][0], dtype=DType.optimal_dtype(vocab))
            for key in json_keys
        }
        with (
            open(input_path, encoding="utf-8") as f,
            multiprocessing.get_context("spawn").Pool(
                max(1, workers), initializer=encode_worker.init_worker, initargs=(tokenizer_model,)
            ) as pool,
        ):
            tasks = ((line, tuple(json_keys), append_eod) for line in f if line.strip())
            encoded_docs = _bounded_imap(pool, tasks, batch=BATCH_PER_WORKER * max(1, workers))
            for encoded in progress(encoded_docs, desc="tokenizing", unit=" docs"):
                for key, ids in encoded.items():  # ids: int32 arrays (cheap to pickle)
                    if len(ids):
                        builders[key].add_document(torch.from_numpy(ids), [len(ids)])
                        stats[key]["documents"] += 1
                        stats[key]["tokens"] += len(ids)
                        lo, hi = int(ids.min()), int(ids.max())
                        if key in ranges:
                            lo, hi = min(lo, ranges[key][0]), max(hi, ranges[key][1])
                        ranges[key] = (lo, hi)
                        if pad >= 0:
                            pads[key] += int(np.count_nonzero(ids == pad))
        for key in json_keys:
            if stats[key]["documents"] == 0:
                raise ValueError(f"{input_path} has no document with text in key {key!r}")
            builders[key].finalize(tmp[key][1])
        for key in json_keys:
            os.replace(tmp[key][0], final[key][0])
            os.replace(tmp[key][1], final[key][1])
            # the launcher's start-up check then need not read the .bin (data/gpt_datasets.py)
            counts = {pad: pads[key]} if pad >= 0 else None
            write_stamp(stats[key]["prefix"], *ranges[key], counts=counts)
    finally:
        for paths in tmp.values():
            for path in paths:
                if os.path.exists(path):
                    os.remove(path)
    return stats
