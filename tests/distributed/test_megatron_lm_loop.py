"""What the hand-written trainer's tests checked, on Megatron-LM's own loop
(:mod:`tst_megatron.training`, ``megatron.training.pretrain()``) on 2 gloo
processes: the TensorBoard scalars against steps and samples (Megatron-LM's and the
launcher's, values read back), an EP=2 resume that equals the uninterrupted run across the
switch, a resume onto another expert layout (Megatron-LM refuses the optimizer state,
``--no-load-optim`` goes on), SIGTERM on one rank saving and stopping every rank, the
switch checkpoint holding a baseline run's keys and loading into a plain megatron-core
``GPTModel``, an all-masked run and ``--eval-iters 0``.

The expected values are computed here from the flags (the learning-rate schedule, the
consumed samples) or read independently (the log lines Megatron-LM prints, the checkpoint
directory, the TensorBoard events).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import traceback

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.training")

from tests.distributed.harness import run_distributed  # noqa: E402
from tests.launcher import BASE, EP2, NO_DROPOUT  # noqa: E402
from tests.launcher import log_lines as _log_lines  # noqa: E402
from tests.launcher import scalars as _scalars  # noqa: E402
from tests.launcher import with_flag as _with  # noqa: E402

N, N1, GBS, T, S = 6, 3, 4, 16, 2  # BASE: 6 iterations, the switch after 3, S = 2
RESUMED_AT = (N1 - 1, N1, N1 + 1)  # resumes before, at and after the switch
V = 128  # BASE's --vocab-size (NullTokenizer: EOD is the last id)
LR = ["--lr-warmup-iters", "2", "--lr-decay-style", "linear", "--min-lr", "1e-4"]
_VALID = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.E+-]+)")
_SAVING = re.compile(r"saving checkpoint at iteration\s+(\d+) to")
_RAW = re.compile(r"TST: iteration\s+(\d+) \| raw tokens per sample: (\d+) \| raw tokens: (\d+)")


def _run_child(rank, world, *, runs):
    """Run ``main(run["argv"])`` for each run in this process, rank 0 sending itself SIGTERM
    after the training forward of iteration ``run.get("sigterm_after")`` (0-based: the
    forward step of iteration ``k`` runs step ``k + 1``) when given. Returns per run
    ``(stdout, exit status or None, traceback or None)``; a failed run does not stop the
    others."""
    import signal

    from megatron.training.training import destroy_global_state

    from tst_megatron.training import cli

    plain = cli.TSTForwardStep  # the forward step cli.main builds
    results = []
    for run in runs:
        at = run.get("sigterm_after")

        class Step(plain):
            def __call__(self, data_iterator, model, _at=at):
                from megatron.training import get_args

                args = get_args()
                if _at is not None and args.curr_iteration == _at and rank == 0:
                    os.kill(os.getpid(), signal.SIGTERM)  # what Slurm sends before preemption
                return super().__call__(data_iterator, model)

        cli.TSTForwardStep = Step  # this spawned test process only
        out, status, failure = io.StringIO(), None, None
        try:
            with contextlib.redirect_stdout(out):
                cli.main(run["argv"])
        except SystemExit as exc:  # train() exits after a signal save
            status = exc.code
        except Exception:
            failure = traceback.format_exc()
        finally:
            cli.TSTForwardStep = plain
        destroy_global_state()
        results.append((out.getvalue(), status, failure))
    return results


def _write_all_eod(prefix):
    """A data file whose every token is the end-of-document id ``V - 1``."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for _ in range(64):
        builder.add_document(torch.full((64,), V - 1, dtype=torch.int32), [64])
    builder.finalize(prefix + ".idx")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One spawn of 2 processes, the runs in sequence (one start-up):

    - ``tb``: DP=2, TensorBoard, a warm-up and linear-decay learning rate, validation at 3
      and 6;
    - ``ep2``: EP=2 MoE (DP=2 for the rest), saving at 2 (and the switch at 3, 4, 6);
    - ``ep2_dropout``: the same with dropout on (0.1), saving every iteration, and
      ``ep2_dropout@<at>`` resumed from it at each of :data:`RESUMED_AT`;
    - ``ep1_from_ep2``: EP=1 (expert DP=2) from the same checkpoint, optimizer state and all;
    - ``ep1_no_load_optim``: the same with ``--no-load-optim``;
    - ``baseline``: the same model without TST (``--tst-bag-size 1``), one step, saved;
    - ``sigterm``: EP=2, ``--exit-signal-handler``, SIGTERM to rank 0 during step 2 of 50;
    - ``all_masked``: every token the EOD id with ``--eod-mask-loss``, across the switch,
      validation at 3 and 4 (phase 1 and phase 2);
    - ``no_eval``: ``--eval-iters 0`` (the switch must not add a validation).
    """
    root = tmp_path_factory.mktemp("loop")
    return _all_runs(root), root


def _all_runs(root):
    base = BASE + NO_DROPOUT
    moe = base + EP2
    moe += ["--ckpt-format", "torch_dist", "--tensorboard-dir"]
    ep2, drop = str(root / "ep2"), str(root / "ep2_dropout")
    dropout = BASE + EP2 + ["--ckpt-format", "torch_dist", "--tensorboard-dir"]
    eod = str(root / "eod")
    real_data = [a for a in base if a != "--mock-data"]
    _write_all_eod(eod)
    argvs = {
        "tb": base + LR + ["--tensorboard-dir", str(root / "tb"), "--log-timers-to-tensorboard"],
        "ep2": moe + [str(root / "tb_ep2"), "--save", ep2, "--save-interval", "2"],
        # Megatron-LM's default dropout (0.1) on, resumed at N1 - 1, N1 and N1 + 1
        "ep2_dropout": dropout + [str(root / "tb_dropout"), "--save", drop, "--save-interval", "1"],
        **{
            f"ep2_dropout@{at}": dropout
            + [str(root / f"tb_dropout@{at}"), "--load", drop, "--ckpt-step", str(at)]
            for at in RESUMED_AT
        },
        "ep1_from_ep2": _with(moe, "--expert-model-parallel-size", "1")
        + [str(root / "tb_ep1_failed"), "--load", ep2, "--ckpt-step", "2"],
        "ep1_no_load_optim": _with(moe, "--expert-model-parallel-size", "1")
        + [str(root / "tb_ep1"), "--load", ep2, "--ckpt-step", "2", "--no-load-optim"],
        "baseline": _with(
            _with(_with(moe, "--tst-bag-size", "1"), "--tst-phase1-iters", "0"),
            "--train-iters",
            "1",
        )
        + [str(root / "tb_base"), "--save", str(root / "baseline"), "--save-interval", "1"],
        "sigterm": moe
        + [str(root / "tb_sig"), "--exit-signal-handler", "--save", str(root / "sig")]
        + ["--save-interval", "1000", "--train-iters", "50"],
        "all_masked": _with(_with(real_data, "--train-iters", "4"), "--eval-interval", "4")
        + ["--data-path", eod, "--split", "80,20,0", "--eod-mask-loss"]
        + ["--tensorboard-dir", str(root / "tb_masked")],
        "no_eval": _with(_with(base, "--train-iters", "4"), "--eval-iters", "0")
        + ["--eval-interval", "1"],
    }
    only = os.environ.get("LOOP_RUNS")  # debugging: a comma-separated subset
    if only:
        argvs = {k: v for k, v in argvs.items() if k in only.split(",")}
    runs = [{"argv": a} for a in argvs.values()]
    if "sigterm" in argvs:
        runs[list(argvs).index("sigterm")]["sigterm_after"] = 1
    first, last = run_distributed(_run_child, 2, runs=runs)
    return {name: (first[i], last[i]) for i, name in enumerate(argvs)}


def _ok(run):
    """The last rank's stdout of a run that neither raised nor exited."""
    (_, _, failed0), (out, status, failed) = run
    assert failed0 is None and failed is None, failed0 or failed
    assert status is None, out[-3000:]
    return out


def _lr(iteration: int) -> float:
    """Megatron-LM's ``OptimizerParamScheduler.get_lr`` for the flags of ``LR`` (lr 1e-3,
    2 warm-up iterations from 0, then linear to 1e-4 at ``--train-iters``), after
    ``iteration`` steps (``train_step`` steps the scheduler before the value is logged)."""
    lr, warmup, low = 1e-3, 2, 1e-4
    if iteration <= warmup:
        return lr * iteration / warmup
    return low + (lr - low) * (1 - (iteration - warmup) / (N - warmup))


@pytest.mark.slow
def test_tensorboard_scalars_against_steps_and_samples(runs):
    out = _ok(runs[0]["tb"])
    tb = _scalars(str(runs[1] / "tb"))
    logged = _log_lines(out)
    steps = list(range(1, N + 1))
    samples = {i: i * GBS for i in steps}  # Megatron-LM's x axis "vs samples"
    # Megatron-LM's own
    assert sorted(tb["learning-rate"]) == steps
    for i in steps:
        assert tb["learning-rate"][i] == pytest.approx(_lr(i), rel=1e-6), i
        assert tb["learning-rate vs samples"][samples[i]] == tb["learning-rate"][i]
    assert tb["batch-size"] == {i: GBS for i in steps}
    assert all(v > 0 and math.isfinite(v) for v in tb["grad-norm"].values())
    # the losses: phase 1 under "mce loss", phase 2 under "lm loss", each the log line's value
    mce, lm = tb["mce loss"], tb["lm loss"]
    assert sorted(mce) == [1, 2, 3] and sorted(lm) == [4, 5, 6]
    assert sorted(tb["mce loss vs samples"]) == [samples[i] for i in (1, 2, 3)]
    assert sorted(tb["lm loss vs samples"]) == [samples[i] for i in (4, 5, 6)]
    # TensorBoard has each iteration's value, the log line the average since the last line
    # (Megatron-LM's training_log does not reset its sums after the first iteration, so
    # the line at 2 averages 1 and 2)
    line = {**mce, **lm, 2: (mce[1] + mce[2]) / 2}
    for key, series in (("mce loss", mce), ("lm loss", lm)):
        for i, value in series.items():
            assert line[i] == pytest.approx(logged[i][key], rel=1e-5), (key, i)
            assert tb[f"{key} vs samples"][samples[i]] == value
    # a barely trained model: each scored target (a bag's token, or the next token) costs
    # about log V
    assert all(abs(v - math.log(V)) < 1.0 for v in (*mce.values(), *lm.values()))
    valid = {int(i): float(v) for i, v in _VALID.findall(out)}
    assert sorted(valid) == [N1, N]
    # (at 6 pretrain()'s final rounds on the validation and test sets write the same tag
    # again, at the same step: Megatron-LM's)
    assert tb["lm loss validation"][N1] == pytest.approx(valid[N1], rel=1e-5)
    assert sorted(tb["lm loss validation"]) == [N1, N]
    # the launcher's
    assert tb["tst-phase"] == {i: 1.0 if i <= N1 else 2.0 for i in steps}
    # the raw tokens read through each iteration, summed plainly: S*T per phase-1 sample, T
    # after (counting --seq-length tokens in phase 1 would be S = 2 times too low)
    raw = {i: GBS * (S * T * min(i, N1) + T * max(i - N1, 0)) for i in steps}
    assert tb["raw-tokens"] == raw
    printed = {int(i): (int(n), int(r)) for i, n, r in _RAW.findall(out)}
    per_sample = {i: n for i, (n, _) in printed.items()}
    assert {i: r for i, (_, r) in printed.items()} == raw, out[-3000:]
    assert per_sample == {i: S * T if i <= N1 else T for i in steps}, out[-3000:]


def _train_losses(tb) -> dict:
    return {**tb.get("mce loss", {}), **tb.get("lm loss", {})}


@pytest.mark.slow
@pytest.mark.parametrize("at", RESUMED_AT)
def test_ep2_resume_with_dropout_equals_the_uninterrupted_run_across_the_switch(runs, at):
    """EP=2 with Megatron-LM's default dropout (0.1), resumed at N1 - 1 (phase 1), N1 (the
    switch) and N1 + 1 (phase 2): every later loss bitwise. On the CPU runtime dropout draws
    from torch's global CPU generator, from which ``iter(DataLoader)`` would also draw after
    the resume restored it (``runtime/cpu.py``, point 6); without that this fails at every
    ``at`` (on a GPU dropout draws from the CUDA generator)."""
    out_a, out_b = _ok(runs[0]["ep2_dropout"]), _ok(runs[0][f"ep2_dropout@{at}"])
    a = _scalars(str(runs[1] / "tb_dropout"))
    b = _scalars(str(runs[1] / f"tb_dropout@{at}"))
    assert sorted(_train_losses(a)) == list(range(1, N + 1)), out_a[-3000:]
    assert sorted(_train_losses(b)) == list(range(at + 1, N + 1)), out_b[-3000:]
    for i in range(at + 1, N + 1):  # the same layout, weights, optimizer, RNG and data
        assert _train_losses(b)[i] == _train_losses(a)[i], (at, i)
    assert b["lm loss validation"][N] == a["lm loss validation"][N]
    assert b["grad-norm"][N] == a["grad-norm"][N]
    # and dropout is on: the same run without it trains on other numbers
    assert _train_losses(a)[1] != _train_losses(_scalars(str(runs[1] / "tb_ep2")))[1]


@pytest.mark.slow
def test_a_resume_onto_another_expert_layout_needs_no_load_optim(runs):
    """Megatron-LM's behaviour: the model state of a torch_dist checkpoint is resharded onto
    another expert layout (EP=2 -> EP=1), the optimizer state is not (EP > 1 chains a dense
    and an expert optimizer; EP = 1 has one): ``load_checkpoint`` would raise megatron-core's
    ``ValueError`` ("Could not find parameter group with key ... in loaded checkpoint") on
    every rank after the model is built. The launcher stops first, with status 2 and one line
    naming ``--no-load-optim`` (``checks/architecture.layout_problems``; the line's words:
    ``tests/unit/test_megatron_lm_args.py``), and ``--no-load-optim`` resumes with the weights
    (fresh Adam moments)."""
    (out0, status0, failed0), (_, status1, failed1) = runs[0]["ep1_from_ep2"]
    assert failed0 is None and failed1 is None, failed0 or failed1
    assert status0 == 2 and status1 == 2
    assert "building GPT model" not in out0 and "loading distributed checkpoint" not in out0
    assert sorted(int(i) for i in _SAVING.findall(runs[0]["ep2"][0][0])) == [2, N1, 4, N]
    out = _ok(runs[0]["ep1_no_load_optim"])
    first = runs[0]["ep1_no_load_optim"][0][0]
    assert "loading distributed checkpoint from" in first and "at iteration 2" in first
    losses = _train_losses(_scalars(str(runs[1] / "tb_ep1")))
    assert sorted(losses) == [3, 4, 5, 6], out[-3000:]
    # the weights of iteration 2: the first step's loss is the uninterrupted run's (the Adam
    # moments act only on the update after it)
    a = _train_losses(_scalars(str(runs[1] / "tb_ep2")))
    assert losses[3] == pytest.approx(a[3], rel=1e-5)
    assert losses[6] != a[6]  # fresh moments: another trajectory


@pytest.mark.slow
def test_sigterm_on_one_rank_saves_and_stops_every_rank(runs):
    (first, status0, failed0), (last, status1, failed1) = runs[0]["sigterm"]
    assert failed0 is None and failed1 is None, failed0 or failed1
    assert status0 in (0, None) and status1 in (0, None)
    assert "exiting program after receiving SIGTERM" in first, first[-3000:]
    assert " iteration        2/      50 |" in last and " iteration        3/" not in last
    sig = runs[1] / "sig"
    assert (sig / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert sorted(p for p in os.listdir(sig) if p.startswith("iter_")) == ["iter_0000002"]
    # status 0 as in Megatron-LM; the launcher's exit marker tells a wrapper it stopped early
    marker = json.loads((sig / "tst_exit.json").read_text())
    assert marker == {"status": "stopped_early", "iteration": 2, "train_iters": 50}, marker
    assert "TST: stopped early at checkpoint iteration 2 of 50" in first, first[-3000:]
    finished = json.loads((runs[1] / "ep2" / "tst_exit.json").read_text())
    assert finished == {"status": "finished", "iteration": 6, "train_iters": 6}, finished


def _model_keys(path):
    from megatron.core import dist_checkpointing

    return sorted(
        k
        for k in dist_checkpointing.load_tensors_metadata(path)
        if k.startswith(("decoder", "embedding", "output"))
    )


def _load_plain_child(rank, world, *, path, baseline):
    """The model keys of the checkpoints ``path`` and ``baseline``; and a plain megatron-core
    ``GPTModel`` (megatron-core's own local spec, BASE + EP2's settings with Megatron-LM's
    defaults) loading the model state of ``path``."""
    keys = (_model_keys(path), _model_keys(baseline))
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_moe_experts=4,
        moe_router_topk=2,
        add_bias_linear=False,
        use_cpu_initialization=True,
    )
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(num_experts=4),
        vocab_size=128,
        max_sequence_length=16,
        share_embeddings_and_output_weights=False,
    )
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, path)
    result = model.load_state_dict(state["model"], strict=False)
    norm = model.decoder.final_layernorm.weight
    return {
        "keys": keys,
        "missing": [k for k in result.missing_keys if not k.endswith("_extra_state")],
        "unexpected": [k for k in result.unexpected_keys if not k.endswith("_extra_state")],
        "moved": not torch.equal(norm, torch.ones_like(norm)),  # trained weights, not init
    }


@pytest.mark.slow
def test_switch_checkpoint_has_baseline_keys_and_loads_into_plain_gptmodel(runs):
    _ok(runs[0]["ep2"])
    _ok(runs[0]["baseline"])
    root = runs[1]
    switch, baseline = root / "ep2" / "iter_0000003", root / "baseline" / "iter_0000001"
    (loaded,) = run_distributed(_load_plain_child, 1, path=str(switch), baseline=str(baseline))
    tst_keys, base_keys = loaded.pop("keys")
    assert tst_keys == base_keys
    assert "decoder.layers.mlp.router.weight" in tst_keys
    assert any(".experts." in k for k in tst_keys)
    assert loaded == {"missing": [], "unexpected": [], "moved": True}


@pytest.mark.slow
def test_an_all_masked_run_reports_no_loss_for_what_scored_no_token(runs):
    """Megatron-LM's behaviour now, kept: a step or validation round that scored no token
    (every label masked) has a loss sum and a token count of 0, and Megatron-LM divides
    them (``train_step``, ``evaluate``): NaN, never a made-up 0. ``training_log`` prints a
    key only when its average is ``>= 0``, so the step's line carries no loss; TensorBoard
    gets NaN; the validation line prints ``NAN`` (and ``exp(min(20, nan))`` = exp(20) as
    its PPL: Megatron-LM's). The gradient is 0: nothing is learned from the masked data."""
    out = _ok(runs[0]["all_masked"])
    logged = _log_lines_raw(out)
    assert sorted(logged) == [1, 2, 3, 4], out[-3000:]
    for i in (1, 2, 3):
        assert "mce loss" not in logged[i] and "lm loss" not in logged[i], (i, logged[i])
    assert "lm loss" not in logged[4]  # (its "mce loss: 0" is the phase-1 key, never forgotten)
    assert len(re.findall(r"\| grad norm: 0\.000 \|", out)) == 4
    valid = dict(_VALID_RAW.findall(out))
    assert sorted(valid) == ["3", "4"] and set(valid.values()) == {"NAN"}, out[-3000:]
    tb = _scalars(str(runs[1] / "tb_masked"))
    assert sorted(tb["mce loss"]) == [1, 2, 3] and sorted(tb["lm loss"]) == [4]
    for key in ("mce loss", "lm loss", "lm loss validation"):
        assert all(math.isnan(v) for v in tb[key].values()), (key, tb[key])
    assert sorted(tb["lm loss validation"]) == [3, 4]


_VALID_RAW = re.compile(r"validation loss at iteration (\d+) \| lm loss value: (\S+) \|")


def _log_lines_raw(text: str) -> dict:
    """``{iteration: {key: value text}}`` of the training log lines."""
    lines = {}
    for i, rest in re.findall(r"iteration\s+(\d+)/\s*\d+ \|(.*)", text):
        lines[int(i)] = dict(re.findall(r"\| (mce loss|lm loss): (\S+) ", "|" + rest))
    return lines


@pytest.mark.slow
def test_eval_iters_0_skips_validation_at_the_switch_too(runs):
    (first, _, _), _ = runs[0]["no_eval"]
    out = _ok(runs[0]["no_eval"])
    assert sorted(_log_lines(out)) == [1, 2, 3, 4], out[-3000:]
    assert "validation loss" not in out
    assert "TST: phase 2 (next-token) from iteration 3 (switch at 3)" in first
    assert "validation" not in first.split("TST: phase 2")[1].split("\n")[0]


def _results_queue_child(rank, world, *, argv):
    """``main(argv)``, then how megatron-core's torch_dist write-results queue was started."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.training.training import destroy_global_state

    from tst_megatron.training.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(argv)
    destroy_global_state()
    return out.getvalue(), filesystem_async._results_queue._manager._ctx.get_start_method()


@pytest.mark.slow
def test_a_cpu_run_starts_the_checkpoint_results_queue_by_fork(tmp_path):
    """megatron-core starts the queue of its first torch_dist save with a 'spawn' Manager,
    whose server re-imports the launcher (about 8 s a run on 2 cores); a CPU run starts it by
    'fork' beforehand, as Megatron-LM's persistent checkpoint worker does."""
    argv = _with(_with(BASE, "--train-iters", "2"), "--tst-phase1-iters", "1")
    argv += ["--save", str(tmp_path / "ckpt"), "--save-interval", "2"]
    argv += ["--ckpt-format", "torch_dist"]
    ((printed, method),) = run_distributed(_results_queue_child, 1, argv=argv)
    assert re.findall(r"saving checkpoint at iteration\s+(\d+) to", printed) == ["1", "2"]
    assert method == "fork"
