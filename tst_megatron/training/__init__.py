"""TST inside Megatron-LM's own training loop (``megatron.training.pretrain()``), one module
per job:

- :mod:`.cli`: the launcher's ``main`` (checks, then ``pretrain()``), torchrun/Slurm glue;
- :mod:`.flags`: ``--tst-*`` (from :class:`~tst_megatron.superposition.schedule.TSTConfig`),
  ``--dry-run``, ``--device``, the flags a CPU run appends;
- :mod:`.plan`: train iterations, consumed samples, ``N1``, the switch sample, resume checks;
- :mod:`.checks`: the launcher's rules on top of Megatron-LM's validation;
- :mod:`.validate`: the one check path of the launch and the dry run;
- :mod:`.assumed`: what a dry run answers for a cluster's GPU and Transformer Engine;
- :mod:`.dry_run`: ``--dry-run``'s report (layout, parameter counts, TST plan);
- :mod:`.model`: the model provider and local layer specs; :mod:`.gpt`: ``TSTGPTModel``;
- :mod:`.datasets`: the datasets provider; :mod:`.data`: megatron-core's datasets, checked;
  :mod:`.stream`: TST's sample orders, cached per node; :mod:`.index_cache`: megatron-core's
  index caches per node;
- :mod:`.forward`: the forward step of both phases; :mod:`.switch`: the switch at ``N1``;
- :mod:`.fp8`: FP8 shape rules from the model's ``TransformerConfig``.
"""

from tst_megatron.training.model import build_model_from_args, gpt_block_spec

__all__ = ["build_model_from_args", "gpt_block_spec"]
