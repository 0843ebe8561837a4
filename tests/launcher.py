"""What the tests of the launcher (``examples/pretrain_gpt_tst.py``, Megatron-LM's ``pretrain()``
with TST) share: a tiny launch line, the child that runs ``pretrain()`` in a process spawned
by :func:`tests.distributed.harness.run_distributed`, and readers of what Megatron-LM prints
and writes (log lines, TensorBoard scalars); and a runner for the benchmark scripts, which
launch it.

The readers parse Megatron-LM's own output independently of the code under test: the training
log lines of ``training_log`` (last rank), ``validation loss at iteration N`` lines, and
TensorBoard events.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

#: The repository root (``examples/``, ``benchmarks/``, ``tools/``).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: A tiny GPT on mock data: 6 iterations, the switch after 3 (S = 2), validation at 3 and 6.
BASE = [
    "--device", "cpu", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "16",
    "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "6",
    "--lr", "1e-3", "--log-interval", "1", "--eval-interval", "3", "--eval-iters", "1",
    "--num-workers", "0", "--seed", "1234",
    "--tst-bag-size", "2", "--tst-phase1-iters", "3",
    # PP=2 on a CPU needs untied embeddings; the vocabulary is not padded at TP=2
    "--untie-embeddings-and-output-weights", "--make-vocab-size-divisible-by", "64",
]  # fmt: skip

#: MoE on 2 expert ranks (alltoall dispatcher).
EP2 = [
    "--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-router-topk", "2",
    "--moe-token-dispatcher-type", "alltoall", "--moe-aux-loss-coeff", "1e-2",
    "--disable-bias-linear",
]  # fmt: skip

#: One multi-token-prediction layer (Megatron-LM refuses MTP with learned absolute positions).
MTP = ["--mtp-num-layers", "1", "--position-embedding-type", "rope"]

#: The distributed optimizer with overlapped reduce-scatter and all-gather, in small buckets
#: (some hold only MTP parameters), as every published MoE recipe runs it.
DIST_OPT = [
    "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
    "--ddp-bucket-size", "2000",
]  # fmt: skip

#: Dropout off: the losses depend on data and weights only.
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]


def without(argv, flag):
    """``argv`` without ``flag`` and its one value."""
    i = argv.index(flag)
    return argv[:i] + argv[i + 2 :]


def with_flag(argv, flag, value):
    """``argv`` with ``flag value`` replacing the flag's value (or appended)."""
    argv = list(argv)
    if flag in argv:
        argv[argv.index(flag) + 1] = value
        return argv
    return argv + [flag, value]


def pretrain_child(rank, world, *, runs, keep_going=False, fork=False, model="gpt"):
    """Run the launcher's ``main(argv, family=...)`` for each argv in ``runs`` in this process,
    one after another; return what each printed to stdout (a list of strings). ``model``: the
    family's name (``tst_megatron.models.family.FAMILIES``), ``"gpt"``
    (``examples/pretrain_gpt_tst.py``) or ``"hybrid"`` (``examples/pretrain_hybrid_tst.py``).

    Each run starts with a fresh megatron-core MoE metrics tracker (a module global that
    ``destroy_global_state`` keeps, sized by the first MoE run's layer count) and ends with
    Megatron-LM's ``destroy_global_state``. With ``keep_going`` a run that raises returns its
    traceback in its output, so the other runs (and their tests) still run. With ``fork``,
    DataLoader workers start with Python's default ``fork``, as in a torchrun worker: a
    process spawned by the harness inherits ``spawn``, with which the DataLoader cannot pickle
    the worker init function Megatron-LM's ``build_pretraining_data_loader`` defines inside
    itself (``--num-workers`` > 0).
    """
    import contextlib
    import io
    import multiprocessing
    import traceback

    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    from megatron.training.training import destroy_global_state

    from tst_megatron.models.family import FAMILIES
    from tst_megatron.training.cli import main

    if fork:
        multiprocessing.set_start_method("fork", force=True)
    printed = []
    for argv in runs:
        destroy_moe_metrics_tracker()
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                main(argv, family=FAMILIES[model])
        except Exception:
            if not keep_going:
                raise
            out.write("\nrun failed:\n" + traceback.format_exc())
        finally:
            destroy_global_state()
        printed.append(out.getvalue())
    return printed


_TRAIN = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.E+-]+) \|")
#: phase 1 reports its multi-hot cross-entropy as ``mce loss`` (no ``lm loss`` on its lines)
_PHASE1 = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| mce loss: ([0-9.E+-]+) \|")
VALID = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.E+-]+)")
_LOG = re.compile(r"iteration\s+(\d+)/\s*\d+ \|(.*)")
_KEY = r"\| {}: ([0-9.E+-]+) \|"


def losses(text: str) -> tuple[dict, dict]:
    """``({iteration: training loss text}, {iteration: validation loss text})`` of what
    Megatron-LM printed: the training loss is ``lm loss`` in phase 2, ``mce loss`` in phase 1."""
    train = {int(i): v for i, v in _PHASE1.findall(text)}
    train.update({int(i): v for i, v in _TRAIN.findall(text)})
    valid = {int(i): v for i, v in VALID.findall(text)}
    return train, valid


def switched_at_3(first: str, last: str) -> tuple[dict, dict]:
    """The training and validation losses (:func:`losses`) of a run of :data:`BASE` whose
    first and last ranks printed ``first`` and ``last``, once checked: finite training losses
    at iterations 1 to 6, validation at 3 and 6, phase 1 from iteration 0 until 3, phase 2
    from the switch at 3."""
    train, valid = losses(last)
    assert sorted(train) == [1, 2, 3, 4, 5, 6], last[-3000:]
    assert all(math.isfinite(float(v)) for v in train.values())
    assert sorted(valid) == [3, 6]
    assert "TST: phase 1 (bags) from iteration 0, until 3" in first
    assert "TST: phase 2 (next-token) from iteration 3 (switch at 3)" in first
    return train, valid


def log_lines(text: str, keys=("lm loss", "mce loss")) -> dict:
    """``{iteration: {key: value}}`` of Megatron-LM's training log lines, for each of
    ``keys`` a line shows."""
    lines = {}
    for i, rest in _LOG.findall(text):
        values = {}
        for key in keys:
            m = re.search(_KEY.format(key), "|" + rest)
            if m:
                values[key] = float(m.group(1))
        lines[int(i)] = values
    return lines


def scalars(tb_dir: str) -> dict:
    """``{tag: {step: value}}`` of the TensorBoard events in ``tb_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(tb_dir, size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def pretrain_child_keep_going(rank, world, *, runs, model="gpt"):
    """:func:`pretrain_child` with ``keep_going``: a failed run returns its traceback."""
    return pretrain_child(rank, world, runs=runs, keep_going=True, model=model)


def pretrain_child_forking(rank, world, *, runs):
    """:func:`pretrain_child` with ``fork`` (DataLoader workers as in a torchrun worker)."""
    return pretrain_child(rank, world, runs=runs, fork=True)


def run_benchmark(*argv, timeout: int, **env) -> subprocess.CompletedProcess:
    """``python *argv`` (a script of ``benchmarks/`` and its flags) from the repository root,
    Python's warnings off and ``env`` added to the environment; fails with the end of its
    output unless it exits 0."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", **env)
    result = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result
