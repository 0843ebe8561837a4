"""tst_megatron: Token Superposition Training (TST) for Megatron-Core GPT/MoE pretraining.

Subpackages, lowest layer first (``tests/unit/test_import_contract.py`` holds the order):
  - :mod:`tst_megatron.superposition`: the method (bags, bag-averaged embedding, multi-hot CE,
    the chunked loss head, the phase schedule).
  - :mod:`tst_megatron.runtime`: where the process runs (torch.distributed, model parallel,
    seeds, torchrun/Slurm environment, the CPU/gloo redirection of megatron-core's CUDA
    assumptions).
  - :mod:`tst_megatron.data`: corpus, tokenizer, Megatron ``.bin``/``.idx`` datasets, TST's
    sample orders, checkpoints read as input.
  - :mod:`tst_megatron.models`: the GPT and hybrid models TST trains, their seams, the hybrid
    pattern, the dry run's model report; :mod:`tst_megatron.loop`: what TST hands Megatron-LM's
    training loop (run plan, datasets provider, forward step, switch).
  - :mod:`tst_megatron.training`: the launch layer (entry point, checks, dry run).
  - :mod:`tst_megatron.conversion`: Hugging Face export and import; :mod:`tst_megatron.plots`:
    loss plots from TensorBoard events.
"""

__version__ = "0.1.0"
