"""The launch layer: TST's launcher around Megatron-LM's own training loop
(``megatron.training.pretrain()``), one module per job:

- :mod:`.cli`: the launcher's ``main`` (checks, then ``pretrain()``);
- :mod:`.argv`: the command line as given, before Megatron-LM parses it (and a CPU run's flags);
- :mod:`.flags`: ``--tst-*`` (from :class:`~tst_megatron.superposition.schedule.TSTConfig`),
  ``--dry-run``, ``--dry-run-gpu``, ``--device``, and the flags the launcher refuses;
- :mod:`.validate`: the one check path of the launch and the dry run; :mod:`.checks`: the
  rules on top of Megatron-LM's validation, one module per subject, run from one list;
- :mod:`.dry_run`: ``--dry-run``'s report (layout, parameter counts, TST plan);
  :mod:`.assumed`: what it answers for the cluster's GPU and Transformer Engine;

What it plugs into the loop (the run plan, the datasets provider, the forward step, the
switch) is :mod:`tst_megatron.loop`; the models it launches (``GPT``, ``HYBRID``, their classes
and seams) are :mod:`tst_megatron.models`; both below this package.
"""
