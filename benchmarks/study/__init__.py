"""The TST-vs-baseline study of ``benchmarks/tst_vs_baseline.py``, in parts:

- :mod:`study.definitions`: what a study is (the frozen command line, one run's length and
  seed, the corpus) and the launcher flags of every arm, declaratively;
- :mod:`study.runner`: the corpus, and the arms trained with ``torchrun`` (or read back);
- :mod:`study.analysis`: pure functions of the arms (paired gaps, crossings, the equal-loss
  speedup, intervals, router verdicts);
- :mod:`study.report` and :mod:`study.plots`: the markdown reports and their figures.

A row of a horizons study (one run length) is ``{"steps": N, "baselines": [arm, ...],
"seeds": [{"seed": s, "best": arm, "arms": {label: arm}}, ...]}``: ``baselines`` are the LR
sweep of the first seed, ``seeds[0]`` is that seed at the chosen LR and every other seed runs
at the same LR; every seed is paired with its own baseline. An *arm* is one training run's
``arm.json`` (``valid``: ``[(iteration, loss)]``, ``tokens``, ``switch``, ``command``, ...).
"""
