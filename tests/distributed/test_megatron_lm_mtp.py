"""Multi-token prediction (``--mtp-num-layers``) inside Megatron-LM's own loop on 2 gloo
processes: the MTP block is skipped in phase 1 and trains from the switch
(:class:`tst_megatron.models.gpt.TSTGPTModel`).

One spawn, two ``pretrain()`` runs of the tiny GPT of ``test_megatron_lm.py`` with one MTP
layer (RoPE: Megatron-LM refuses MTP with learned absolute positions):

- DP=2 with ``--overlap-grad-reduce`` and buckets of 1000 elements, so that some buckets hold
  only MTP parameters: megatron-core DDP asserts at the next step when a bucket's parameters
  got no gradient (``_ParamAndGradBucketGroup.reset``), which is why phase 1 gives them an
  exact zero;
- TP=2 with sequence parallelism (the MTP block's layers and its logits are split too).

PP=2 is not run here: with MTP, megatron-core gives the last stage its own copy of the
embedding and sets it up with ``weight.data.cuda()``
(``LanguageModule.setup_embeddings_and_output_layer``, as for tied embeddings), which the
CPU runtime does not redirect.

Both switch in-process with finite losses in both phases, and Megatron-LM logs the MTP loss
(``mtp_1 loss``, ``MTPLossLoggingHelper``) in phase 2 only.

The MTP parameters' Adam from the switch
(:class:`tst_megatron.loop.switch.FreshAdamForMTP`): every AdamW step of every parameter
against a float64 replay (1 process, and DP=2 under the distributed optimizer), and resumes at
and after the switch against the uninterrupted run.
"""

from __future__ import annotations

import math
import re

import pytest

pytest.importorskip("megatron.training")

from tests.distributed.harness import run_distributed  # noqa: E402
from tests.launcher import BASE, DIST_OPT, MTP, NO_DROPOUT, switched_at_3  # noqa: E402
from tests.launcher import pretrain_child as _pretrain_child  # noqa: E402

_MTP_LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| mtp_1 loss: ([0-9.E+-]+) \|")


def _fresh_pretrain_child(rank, world, *, runs):
    """``_pretrain_child`` with megatron-core's MTP logging state emptied before each run:
    ``MTPLossLoggingHelper.tracker`` is a class attribute that Megatron-LM's
    ``destroy_global_state`` leaves in place, so a second ``pretrain()`` in one process
    would log ``mtp_1 loss: 0`` in its phase 1 (the first run's zeroed entry)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    printed = []
    for argv in runs:
        MTPLossLoggingHelper.tracker.clear()
        printed += _pretrain_child(rank, world, runs=[argv])
    return printed


@pytest.fixture(scope="module")
def runs():
    base = BASE + NO_DROPOUT + MTP
    argvs = {
        "dp2": base + ["--overlap-grad-reduce", "--ddp-bucket-size", "1000"],
        "tp2": base + ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    }
    first, last = run_distributed(_fresh_pretrain_child, 2, runs=list(argvs.values()))
    return {name: (first[i], last[i]) for i, name in enumerate(argvs)}


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2", "tp2"])
def test_mtp_trains_from_the_switch_and_is_logged_in_phase2_only(runs, layout):
    first, last = runs[layout]
    _, valid = switched_at_3(first, last)
    assert all(math.isfinite(float(v)) for v in valid.values())
    mtp = {int(i): float(v) for i, v in _MTP_LOSS.findall(last)}
    assert sorted(mtp) == [4, 5, 6], last[-3000:]  # phase 2 only (the switch is at 3)
    assert all(math.isfinite(v) and v > 0 for v in mtp.values())


def _adam_reference_child(rank, world, *, argv, n1):
    """Run ``argv`` with two test hooks on every torch optimizer step, and replay each step of
    each parameter in float64 with plain AdamW (torch's formula: decay, then
    ``p -= lr / (1 - b1**t) * m / (sqrt(v) / sqrt(1 - b2**t) + eps)``).

    A parameter is idle when every phase-1 gradient was exactly zero (found here, not by the
    code under test); its Adam step count ``t`` restarts at the switch. Returns
    ``{"idle": n, "busy": n, "err_idle": e, "err_busy": e, "stale_idle": e}``: the largest
    absolute error of the real update against the reference, and against the reference that
    keeps counting through phase 1 (what a missed reset gives).
    """
    from megatron.training import get_args
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    steps = {}  # id(param) -> list of (iteration, p0, g, lr, wd, betas, eps, p1)

    def pre(opt, *_):
        it = get_args().curr_iteration
        for group in opt.param_groups:
            for p in group["params"]:
                row = [it, p.detach().double().clone(), p.grad.detach().double().clone()]
                row += [group["lr"], group["weight_decay"], group["betas"], group["eps"]]
                steps.setdefault(id(p), []).append(row)

    def post(opt, *_):
        for group in opt.param_groups:
            for p in group["params"]:
                steps[id(p)][-1].append(p.detach().double().clone())

    hooks = [
        register_optimizer_step_pre_hook(pre),
        register_optimizer_step_post_hook(post),
    ]
    try:
        _fresh_pretrain_child(rank, world, runs=[argv])
    finally:
        for hook in hooks:
            hook.remove()

    def replay(rows, restart):
        m = v = None
        errors, t = [], 0
        for it, p0, g, lr, wd, (b1, b2), eps, p1 in rows:
            if restart and it == n1:
                m = v = None
                t = 0
            t += 1
            m = (1 - b1) * g if m is None else b1 * m + (1 - b1) * g
            v = (1 - b2) * g * g if v is None else b2 * v + (1 - b2) * g * g
            ref = p0 * (1 - lr * wd) - lr / (1 - b1**t) * m / (v.sqrt() / (1 - b2**t) ** 0.5 + eps)
            errors.append((it, (p1 - ref).abs().max().item()))
        return errors

    out = {"idle": 0, "busy": 0, "err_idle": 0.0, "err_busy": 0.0, "stale_idle": float("inf")}
    for rows in steps.values():
        idle = all(not row[2].any() for row in rows if row[0] < n1)
        out["idle" if idle else "busy"] += 1
        err = max(e for _, e in replay(rows, restart=idle))
        key = "err_idle" if idle else "err_busy"
        out[key] = max(out[key], err)
        if idle:
            switch_step = dict(replay(rows, restart=False))[n1]
            out["stale_idle"] = min(out["stale_idle"], switch_step)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world,extra", [(1, []), (2, DIST_OPT)], ids=["plain", "distopt-dp2"])
def test_mtp_parameters_start_adam_afresh_at_the_switch(world, extra):
    """MTP's first update after the switch is Adam's first step (step count and moments from
    the switch), every other parameter's steps are plain AdamW throughout, against a float64
    replay of each step; Megatron-LM's default ``--adam-beta2 0.999`` and weight decay 0.1.
    Under the distributed optimizer each rank's shards (views of the parameters) are checked."""
    argv = BASE + NO_DROPOUT + MTP + ["--weight-decay", "0.1", "--eval-iters", "0"] + extra
    for out in run_distributed(_adam_reference_child, world, argv=argv, n1=3):
        assert out["idle"] > 0 and out["busy"] > 0, out
        assert out["err_idle"] < 1e-6 and out["err_busy"] < 1e-6, out
        # a step count kept through phase 1 would be off by far more than the tolerance
        assert out["stale_idle"] > 2e-5, out


@pytest.mark.slow
def test_a_resume_at_or_after_the_switch_continues_mtp_s_adam_exactly(tmp_path):
    """Resumed from the switch checkpoint (iteration 3), MTP's Adam starts afresh as in the
    uninterrupted run; resumed from iteration 4, it keeps the checkpoint's fresh state (no
    second reset). Both equal the uninterrupted run bitwise, ``mtp_1 loss`` included."""
    from tests.launcher import scalars

    base = BASE + NO_DROPOUT + MTP + ["--save-interval", "4", "--ckpt-format", "torch_dist"]
    save = str(tmp_path / "ckpt")
    argvs = [
        base + ["--save", save, "--tensorboard-dir", str(tmp_path / "tb")],
        base + ["--load", save, "--ckpt-step", "3", "--tensorboard-dir", str(tmp_path / "tb3")],
        base + ["--load", save, "--ckpt-step", "4", "--tensorboard-dir", str(tmp_path / "tb4")],
    ]
    run_distributed(_fresh_pretrain_child, 1, runs=argvs)
    whole = scalars(str(tmp_path / "tb"))
    for name, first in (("tb3", 4), ("tb4", 5)):
        resumed = scalars(str(tmp_path / name))
        for key in ("lm loss", "mtp_1 loss"):
            assert sorted(resumed[key]) == list(range(first, 7)), (name, key, resumed[key])
            for i in range(first, 7):
                assert resumed[key][i] == whole[key][i], (name, key, i)
