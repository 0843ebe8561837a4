"""The trainer across the TST switch on 2 gloo processes.

Every 2-process layout (TP=2+SP, PP=2, virtual PP, EP=2, DP=2) resumes from a checkpoint of
a 1-process run and must reproduce that run's losses for the remaining steps, which cross
the phase switch: this checks each layout against the 1-process result, checkpoint
resharding, and resume exactness at once.
"""

import os
import shutil
import signal

import pytest
import torch

from tests.defaults import TEST_DEFAULTS
from tests.distributed.harness import run_distributed

N, N1 = 6, 3
BASE = [
    *TEST_DEFAULTS,
    "--mock-data",
    "--vocab-size",
    "128",
    "--make-vocab-size-divisible-by",
    "64",
    "--num-layers",
    "4",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--ffn-hidden-size",
    "64",
    "--seq-length",
    "16",
    "--swiglu",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
    "--num-experts",
    "4",
    "--moe-ffn-hidden-size",
    "32",
    "--moe-router-topk",
    "2",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--train-iters",
    str(N),
    "--tst-bag-size",
    "4",
    "--tst-phase1-iters",
    str(N1),
    "--lr",
    "3e-3",
    "--lr-warmup-iters",
    "1",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--device",
    "cpu",
    "--log-interval",
    "1",
    "--seed",
    "5",
]


def _train_child(rank, world, *, argv, sigterm_at=None):
    from tst_megatron.training import trainer
    from tst_megatron.training.config import parse_args

    if sigterm_at is not None:
        real_step = trainer.train_step

        def step_then_signal(run, phase, iteration):
            metrics = real_step(run, phase, iteration)
            if iteration + 1 == sigterm_at and rank == 0:
                os.kill(os.getpid(), signal.SIGTERM)  # what Slurm sends before preemption
            return metrics

        trainer.train_step = step_then_signal
    return trainer.train(parse_args(argv))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """1 process, uninterrupted, saving at 2, 3 (the switch), 4, 6."""
    root = tmp_path_factory.mktemp("ref")
    (history,) = run_distributed(
        _train_child,
        1,
        argv=BASE
        + [
            "--save",
            str(root),
            "--save-interval",
            "2",
            "--eval-interval",
            "3",
            "--eval-iters",
            "1",
            "--tensorboard-dir",
            str(root / "tb"),
        ],
    )
    shutil.move(str(root / "tb"), str(root.parent / (root.name + "_tb")))
    return root, history


def _checkpoint_copy(src_root, iteration, dst_root):
    name = f"iter_{iteration:07d}"
    shutil.copytree(os.path.join(src_root, name), os.path.join(dst_root, name))
    with open(os.path.join(dst_root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))


def test_reference_run_switches(reference):
    root, history = reference
    assert sorted(history["train"]) == list(range(1, N + 1))
    assert all(torch.isfinite(torch.tensor(v)) for v in history["train"].values())
    assert sorted(os.listdir(root)) == [
        "iter_0000002",
        "iter_0000003",
        "iter_0000004",
        "iter_0000006",
        "latest_checkpointed_iteration.txt",
    ]
    assert sorted(history["valid"]) == [3, 6]  # next-token validation in phase 1 too


def test_tensorboard_scalars_against_steps_and_tokens(reference):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root, history = reference
    events = EventAccumulator(str(root.parent / (root.name + "_tb")))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in (
        "mce loss",
        "lm loss",
        "learning-rate",
        "grad-norm",
        "tst-phase",
        "validation lm loss",
        "mce loss vs tokens",
        "lm loss vs tokens",
    ):
        assert tag in tags, tag
    phases = [(e.step, e.value) for e in events.Scalars("tst-phase")]
    assert phases == [(i, 1.0 if i <= N1 else 2.0) for i in range(1, N + 1)]
    lm = {e.step: e.value for e in events.Scalars("lm loss")}
    assert lm[N] == pytest.approx(history["train"][N])
    tokens = [e.step for e in events.Scalars("mce loss vs tokens")]
    assert tokens == [4 * 16 * 4 * i for i in range(1, N1 + 1)]  # global batch x S*T per step


LAYOUTS = {
    "tp2_sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "vpp": ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
    "dp2_allgather": ["--moe-token-dispatcher-type", "allgather"],
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_resumes_onto_one_process_trajectory(layout, reference, tmp_path):
    ref_root, ref = reference
    start = 3 if layout == "dp2_allgather" else 2  # also resume at the switch checkpoint
    _checkpoint_copy(ref_root, start, tmp_path)
    ranks = run_distributed(
        _train_child, 2, argv=BASE + LAYOUTS[layout] + ["--load", str(tmp_path)]
    )
    for history in ranks:
        assert sorted(history["train"]) == list(range(start + 1, N + 1))
        for it, loss in history["train"].items():
            assert loss == pytest.approx(ref["train"][it], rel=2e-4, abs=2e-4), (layout, it)


@pytest.mark.slow
def test_ep2_resume_equals_uninterrupted_run_across_switch(tmp_path):
    """EP=2 (DP=2): an uninterrupted run vs one saved at 2 and resumed, through the switch."""
    ep = BASE + [
        "--expert-model-parallel-size",
        "2",
        "--moe-aux-loss-coeff",
        "0.01",
        "--hidden-dropout",
        "0.1",
    ]  # dropout: the RNG states must be restored too
    full = run_distributed(
        _train_child, 2, argv=ep + ["--save", str(tmp_path / "a"), "--save-interval", "2"]
    )
    _checkpoint_copy(tmp_path / "a", 2, tmp_path / "b")
    resumed = run_distributed(_train_child, 2, argv=ep + ["--load", str(tmp_path / "b")])
    for r in range(2):
        assert sorted(resumed[r]["train"]) == [3, 4, 5, 6]
        for it in range(3, N + 1):
            assert resumed[r]["train"][it] == full[r]["train"][it], it  # bitwise


def test_optimizer_layout_mismatch_is_a_clear_error(reference, tmp_path):
    ref_root, _ = reference
    _checkpoint_copy(ref_root, 2, tmp_path)
    with pytest.raises(AssertionError, match="pass --no-load-optim"):
        run_distributed(
            _train_child,
            2,
            argv=BASE + ["--expert-model-parallel-size", "2", "--load", str(tmp_path)],
        )
    ranks = run_distributed(
        _train_child,
        2,
        argv=BASE
        + ["--expert-model-parallel-size", "2", "--load", str(tmp_path), "--no-load-optim"],
    )
    assert sorted(ranks[0]["train"]) == [3, 4, 5, 6]


@pytest.mark.slow
def test_sigterm_saves_and_exits(tmp_path):
    ranks = run_distributed(
        _train_child,
        2,
        sigterm_at=2,
        argv=BASE
        + [
            "--expert-model-parallel-size",
            "2",
            "--exit-signal-handler",
            "--save",
            str(tmp_path),
            "--train-iters",
            "50",
        ],
    )
    for history in ranks:
        assert history["exit"] == "signal"
        assert max(history["train"]) == 2
    with open(tmp_path / "latest_checkpointed_iteration.txt") as f:
        assert f.read() == "2"
    assert not any(name.endswith(".tmp") for name in os.listdir(tmp_path))


def _keys_child(rank, world, *, path):
    from megatron.core import dist_checkpointing

    return sorted(
        k
        for k in dist_checkpointing.load_tensors_metadata(path)
        if k.startswith("decoder") or k.startswith("embedding") or k.startswith("output")
    )


def test_switch_checkpoint_has_baseline_keys_and_loads_into_plain_gptmodel(reference, tmp_path):
    ref_root, _ = reference
    switch_dir = os.path.join(ref_root, "iter_0000003")
    argv = [a for a in BASE]
    argv[argv.index("--tst-bag-size") + 1] = "1"
    argv[argv.index("--tst-phase1-iters") + 1] = "0"
    argv[argv.index("--lr-warmup-iters") + 1] = "0"
    (baseline,) = run_distributed(
        _train_child, 1, argv=argv + ["--train-iters", "1", "--save", str(tmp_path)]
    )
    (tst_keys,) = run_distributed(_keys_child, 1, path=switch_dir)
    (base_keys,) = run_distributed(_keys_child, 1, path=str(tmp_path / "iter_0000001"))
    assert tst_keys == base_keys and "decoder.layers.mlp.router.weight" in tst_keys
    (loaded,) = run_distributed(_load_plain_child, 1, path=switch_dir)
    assert loaded["missing"] == [] and loaded["unexpected"] == []


def _load_plain_child(rank, world, *, path):
    """A plain megatron-core GPTModel (megatron's own local spec) loads the TST checkpoint."""
    from megatron.core import dist_checkpointing
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from tst_megatron.runtime import ParallelConfig, initialize_model_parallel

    initialize_model_parallel(ParallelConfig())
    config = TransformerConfig(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        num_moe_experts=4,
        moe_ffn_hidden_size=32,
        moe_router_topk=2,
        normalization="RMSNorm",
        gated_linear_unit=True,
        add_bias_linear=False,
        use_cpu_initialization=True,
    )
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(num_experts=4, normalization="RMSNorm"),
        vocab_size=128,
        max_sequence_length=16,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, path)
    result = model.load_state_dict(state["model"], strict=False)
    return {
        "missing": [k for k in result.missing_keys if not k.endswith("_extra_state")],
        "unexpected": [k for k in result.unexpected_keys if not k.endswith("_extra_state")],
    }
