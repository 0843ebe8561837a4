"""Real data: a text corpus (JSONL), a SentencePiece tokenizer, and Megatron ``.bin/.idx``
datasets. The ``tools/*.py`` scripts are thin command lines over these modules."""
