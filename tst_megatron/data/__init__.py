"""The data: a text corpus (JSONL), a SentencePiece tokenizer and Megatron ``.bin/.idx``
datasets (the ``tools/*.py`` scripts are thin command lines over these modules); the run's
megatron-core datasets, built and checked where data enters (:mod:`.gpt_datasets`, index
caches per node in :mod:`.index_cache`); and TST's training order over them (:mod:`.stream`),
read by the launcher's datasets provider (:mod:`tst_megatron.loop.datasets`)."""
