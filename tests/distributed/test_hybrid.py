"""TST on megatron-core's ``HybridModel`` (``tst_megatron.models.hybrid``,
``examples/pretrain_hybrid_tst.py``).

- The same architecture as a GPT gives the same numbers: a ``GPTModel`` of L layers and the
  ``HybridModel`` ``*-`` x L (dense) or ``*E`` x L (MoE) with the same weights give the same
  per-slot phase-1 CE, per-token phase-2 CE and parameter gradients (random upstream
  gradient), through the loss seam both share. The weights are mapped by name, and every
  parameter of each model is mapped.
- ``TSTHybridModel`` adds nothing to ``HybridModel``: the same state-dict and
  ``sharded_state_dict`` keys.
- A ``*E*E`` hybrid (4 experts, top-2) trains through the switch in Megatron-LM's loop,
  logging ``mce loss`` in phase 1 and ``lm loss`` in phase 2, and saving at the switch and
  the end; on 2 processes (DP = 2, EP = 2, TP = 2 + SP, PP = 2 by ``|`` in the pattern, EP = 2
  with the distributed optimizer and overlapped gathers; a dense ``*-`` x 4 at PP = 2 with 2
  virtual stages each) as on 1 process, from the same iteration-1 weights; resumed at N1 - 1, N1 and N1 + 1 (EP = 2) it
  continues bitwise.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

pytest.importorskip("megatron.training")

from tests.distributed.harness import (  # noqa: E402
    one_process_args,
    run_distributed,
    set_weights,
    small_config,
)
from tests.launcher import DIST_OPT  # noqa: E402
from tests.launcher import without as _without  # noqa: E402

V, T, S, B, L = 96, 8, 2, 2, 2


def _config(num_layers, experts=None, **extra):
    return small_config(
        num_layers=num_layers, ffn_hidden_size=24, experts=experts, moe_ffn_hidden_size=12, **extra
    )


def _hybrid(pattern, experts=None, cls=None, **extra):
    from tst_megatron.models.hybrid import TSTHybridModel, local_hybrid_stack_spec

    config = _config(len(pattern.split("/")[0]), experts, **extra)
    return (cls or TSTHybridModel)(
        config=config,
        hybrid_stack_spec=local_hybrid_stack_spec(config),
        vocab_size=V,
        max_sequence_length=T * S,
        hybrid_layer_pattern=pattern,
        parallel_output=True,
        position_embedding_type="rope",
    )


def _gpt_to_hybrid(name: str) -> str:
    """A GPT layer ``i``'s attention half is hybrid layer ``2i``, its MLP half ``2i + 1``;
    ``final_layernorm`` is ``final_norm``."""
    m = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
    if m:
        i, rest = int(m.group(1)), m.group(2)
        attention = rest.startswith(("input_layernorm", "self_attention"))
        return f"decoder.layers.{2 * i + (0 if attention else 1)}.{rest}"
    return name.replace("decoder.final_layernorm", "decoder.final_norm")


def _run(model, tokens, upstream, targets, bags, phase):
    """Forward (phase 1: bag-mean inputs and ``[b, T, S]`` targets; phase 2: tokens) and
    backward with ``upstream``; returns the CE and ``{name: grad}``."""
    from tst_megatron.superposition import bag_embedding

    model.zero_grad()
    if phase == 1:
        x = bag_embedding(model.embedding, bags)
        ce = model(None, None, None, decoder_input=x, labels=targets)
    else:
        n = tokens.shape[1] - 1
        positions = torch.arange(n).unsqueeze(0).expand(B, n)
        mask = torch.ones(1, 1, n, n).tril() < 0.5
        ce = model(tokens[:, :-1], positions, mask, labels=tokens[:, 1:])
    ce.backward(upstream[: ce.numel()].view_as(ce))
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return ce.detach(), grads


def _equivalence_child(rank, world):
    from tests.distributed.harness import build_gpt_model
    from tst_megatron.runtime import ParallelConfig, initialize_model_parallel, set_seed
    from tst_megatron.superposition import align_bag_targets, fold_bags

    initialize_model_parallel(ParallelConfig())
    set_seed(3)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, V, (B, S * T + 1), generator=g)
    upstream = torch.randn(B * T * S * S, generator=g) + 0.3  # random, non-unit
    targets, _ = align_bag_targets(tokens[:, 1:], torch.ones(B, S * T), S)
    bags = fold_bags(tokens[:, :-1], S)
    out = {}
    for experts, pattern in ((None, "*-" * L), (4, "*E" * L)):
        gpt = build_gpt_model(_config(L, experts), vocab_size=V, max_sequence_length=T * S)
        hybrid = _hybrid(pattern, experts)
        set_weights(gpt)
        mapped = {_gpt_to_hybrid(k): v for k, v in gpt.state_dict().items()}
        hybrid_keys = set(hybrid.state_dict())
        out[pattern, "keys"] = (sorted(mapped), sorted(hybrid_keys))
        hybrid.load_state_dict(mapped, strict=True)
        for phase in (1, 2):
            ce_gpt, grads_gpt = _run(gpt, tokens, upstream, targets, bags, phase)
            ce_hybrid, grads_hybrid = _run(hybrid, tokens, upstream, targets, bags, phase)
            out[pattern, phase] = (
                ce_gpt,
                ce_hybrid,
                {_gpt_to_hybrid(k): v for k, v in grads_gpt.items()},
                grads_hybrid,
            )
    return out


def test_a_gpt_and_the_equivalent_hybrid_give_the_same_losses_and_gradients():
    (r,) = run_distributed(_equivalence_child, 1)
    for pattern in ("*-" * L, "*E" * L):
        mapped, hybrid_keys = r[pattern, "keys"]
        assert mapped == hybrid_keys, pattern  # every weight has its place, both ways
        for phase in (1, 2):
            ce_gpt, ce_hybrid, grads_gpt, grads_hybrid = r[pattern, phase]
            shape = (B, T, S) if phase == 1 else (B, S * T)
            assert ce_gpt.shape == shape and ce_hybrid.shape == shape
            torch.testing.assert_close(ce_hybrid, ce_gpt, rtol=1e-6, atol=1e-6)
            assert grads_hybrid.keys() == grads_gpt.keys() and len(grads_gpt) > 8
            for name, grad in grads_gpt.items():
                torch.testing.assert_close(
                    grads_hybrid[name], grad, rtol=1e-5, atol=1e-6, msg=f"{pattern} {name}"
                )


def _keys_child(rank, world):
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from tst_megatron.runtime import ParallelConfig, initialize_model_parallel

    initialize_model_parallel(ParallelConfig())
    found = {}
    for experts, pattern in ((None, "*-*-"), (4, "*E*E")):
        models = [_hybrid(pattern, experts, cls) for cls in (HybridModel, None)]
        found[pattern] = [(sorted(m.state_dict()), sorted(m.sharded_state_dict())) for m in models]
    return found


def test_the_tst_hybrid_model_has_a_baseline_hybrid_models_keys():
    (found,) = run_distributed(_keys_child, 1)
    for pattern, (base, tst) in found.items():
        assert tst == base and len(base[0]) > 10, pattern


#: A tiny ``*E*E`` hybrid on mock data: 4 experts top-2 (alltoall, aux loss), the switch
#: after 3 of 6 iterations, 4 micro-batches per step.
HYBRID_MOE = [
    "--device", "cpu", "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "128", "--make-vocab-size-divisible-by", "64",
    "--hybrid-layer-pattern", "*E*E", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "16",
    "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope",
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall",
    "--moe-aux-loss-coeff", "1e-2", "--disable-bias-linear",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "6",
    "--lr", "1e-3", "--log-interval", "1", "--eval-interval", "3", "--eval-iters", "1",
    "--num-workers", "0", "--seed", "1234", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--tst-bag-size", "2", "--tst-phase1-iters", "3", "--ckpt-format", "torch_dist",
]  # fmt: skip
#: the 2-process layouts: Megatron-LM's initialisation depends on the layout (experts per
#: expert rank, seeds per stage), so each starts from the 1-process run's iteration-1 weights
#: with a fresh optimizer, as does the reference it is compared with
LAYOUTS = {
    "dp2": [],
    "ep2": ["--expert-model-parallel-size", "2"],
    "tp2_sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2", "--hybrid-layer-pattern", "*E|*E"],
    # the distributed optimizer with overlapped reduce-scatter and all-gather, at EP = 2
    "ep2_distopt": ["--expert-model-parallel-size", "2", *DIST_OPT],
}


#: :data:`HYBRID_MOE` with RMSNorm and SwiGLU, as the Hugging Face targets hold them.
EXPORTABLE = HYBRID_MOE + ["--normalization", "RMSNorm", "--swiglu"]


def _dense(argv):
    """``argv`` as the dense hybrid ``*-*-*-*-`` (no MoE flags): 8 layers, so that PP = 2 with
    virtual stages (``*-|*-|*-|*-``) gives every stage layers of both kinds."""
    argv = list(argv)
    for flag, values in (
        ("--num-experts", 1),
        ("--moe-router-topk", 1),
        ("--moe-token-dispatcher-type", 1),
        ("--moe-aux-loss-coeff", 1),
    ):
        i = argv.index(flag)
        del argv[i : i + 1 + values]
    argv[argv.index("--hybrid-layer-pattern") + 1] = "*-*-*-*-"
    return argv  # fmt: skip


#: the dense model's 2-process layout: four '|' segments on 2 stages, 2 virtual stages each
#: (Megatron-LM derives VPP from them)
DENSE_LAYOUTS = {
    "pp2_vpp": ["--pipeline-model-parallel-size", "2", "--hybrid-layer-pattern", "*-|*-|*-|*-"]
}
#: float32 sums in another order (the GPT layouts measure one ulp)
REL = 1e-6
#: N1 - 1, N1 and N1 + 1: resumes before, at and after the switch
RESUMED_AT = (2, 3, 4)


def _train_losses(tb: dict) -> dict:
    return {**tb.get("mce loss", {}), **tb.get("lm loss", {})}


@pytest.fixture(scope="module")
def hybrid_runs(tmp_path_factory):
    """1 process from scratch (saving every iteration), then 1 process and each 2-process
    layout from its iteration 1 with a fresh optimizer, saving at the switch and the end.
    ``{run: (printed by the last rank, TensorBoard scalars, checkpoint directory)}``."""
    from tests.launcher import pretrain_child_keep_going as child
    from tests.launcher import scalars

    root = tmp_path_factory.mktemp("hybrid")

    def argv(name, extra, base=HYBRID_MOE):
        return base + extra + [
            "--tensorboard-dir", str(root / f"tb_{name}"), "--save", str(root / name),
        ]  # fmt: skip

    def start(scratch):
        return ["--load", str(root / scratch), "--ckpt-step", "1", "--no-load-optim",
                "--no-load-rng", "--save-interval", "1"]  # fmt: skip

    every = ["--save-interval", "1"]
    ones = {"scratch": argv("scratch", every), "one": argv("one", start("scratch"))}
    ones["mtp"] = argv("mtp", ["--hybrid-layer-pattern", "*E*E/*E", "--save-interval", "3"])
    dense = _dense(HYBRID_MOE)
    ones["dense_scratch"] = argv("dense_scratch", every, dense)
    ones["dense_one"] = argv("dense_one", start("dense_scratch"), dense)
    # RMSNorm + SwiGLU (what the Hugging Face targets hold), for the export: dense on 1
    # process, MoE at PP = 2
    ones["export_dense"] = argv("export_dense", ["--save-interval", "3"], _dense(EXPORTABLE))
    ((*printed,),) = run_distributed(child, 1, runs=list(ones.values()), model="hybrid")
    twos = {name: argv(name, start("scratch") + flags) for name, flags in LAYOUTS.items()}
    for name, flags in DENSE_LAYOUTS.items():
        twos[name] = argv(name, start("dense_scratch") + flags, dense)
    # EP = 2 with Megatron-LM's default dropout (0.1), resumed from its own checkpoints
    # around the switch
    dropout = _without(_without(HYBRID_MOE, "--hidden-dropout"), "--attention-dropout")
    twos["ep2_dropout"] = argv("ep2_dropout", start("scratch") + LAYOUTS["ep2"], dropout)
    for at in RESUMED_AT:
        twos[f"ep2@{at}"] = dropout + LAYOUTS["ep2"] + [
            "--tensorboard-dir", str(root / f"tb_ep2@{at}"),
            "--load", str(root / "ep2_dropout"), "--ckpt-step", str(at),
        ]  # fmt: skip
    twos["export_pp2"] = argv("export_pp2", LAYOUTS["pp2"] + ["--save-interval", "3"], EXPORTABLE)
    _, (*last,) = run_distributed(child, 2, runs=list(twos.values()), model="hybrid")
    texts = dict(zip([*ones, *twos], [*printed, *last]))
    return {
        name: (text, scalars(str(root / f"tb_{name}")), str(root / name))
        for name, text in texts.items()
    }


@pytest.mark.slow
def test_a_hybrid_moe_trains_through_the_switch_logging_both_losses(hybrid_runs):
    from tests.launcher import log_lines

    text, tb, save = hybrid_runs["scratch"]
    lines = log_lines(text)
    assert all("mce loss" in lines[i] and "lm loss" not in lines[i] for i in (1, 2, 3)), lines
    assert all(lines[i].get("lm loss", 0) > 0 for i in (4, 5, 6)), lines
    assert "TST: phase 2 (next-token) from iteration 3 (switch at 3)" in text
    assert sorted(tb["mce loss"]) == [1, 2, 3] and sorted(tb["lm loss"]) == [4, 5, 6]
    assert all(v > 0 for v in tb["load_balancing_loss"].values())
    one = hybrid_runs["one"][2]
    assert {"iter_0000003", "iter_0000006"} <= set(os.listdir(one)), os.listdir(one)


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS) + sorted(DENSE_LAYOUTS))
def test_each_hybrid_layout_trains_through_the_switch_as_one_process(layout, hybrid_runs):
    text, tb, save = hybrid_runs[layout]
    dense = layout in DENSE_LAYOUTS
    _, ref, _ = hybrid_runs["dense_one" if dense else "one"]
    got, want = _train_losses(tb), _train_losses(ref)
    assert sorted(got) == sorted(want) == [2, 3, 4, 5, 6], text[-3000:]
    for i in want:
        assert got[i] == pytest.approx(want[i], rel=REL, abs=0), (layout, i)
    for i in (3, 6):
        assert tb["lm loss validation"][i] == pytest.approx(
            ref["lm loss validation"][i], rel=REL, abs=0
        ), (layout, i)
    for i in (2, 3, 4, 5, 6) if not dense else ():  # Megatron-LM's balancing-loss log
        assert tb["load_balancing_loss"][i] == pytest.approx(
            ref["load_balancing_loss"][i], rel=REL, abs=0
        ), (layout, i)
    assert {"iter_0000003", "iter_0000006"} <= set(os.listdir(save)), os.listdir(save)


@pytest.mark.slow
@pytest.mark.parametrize("at", RESUMED_AT)
def test_a_hybrid_resumed_around_the_switch_continues_bitwise(at, hybrid_runs):
    """EP = 2 with dropout 0.1, resumed at N1 - 1, N1 and N1 + 1 (``runtime/cpu.py`` point 6
    keeps dropout's generator out of the data iterators' way)."""
    text, resumed, _ = hybrid_runs[f"ep2@{at}"]
    _, tb, _ = hybrid_runs["ep2_dropout"]
    assert _train_losses(tb)[2] != _train_losses(hybrid_runs["ep2"][1])[2]  # dropout is on
    got, want = _train_losses(resumed), _train_losses(tb)
    assert sorted(got) == list(range(at + 1, 7)), text[-3000:]
    for i in got:  # the same layout, weights, optimizer state and data
        assert got[i] == want[i], (at, i)
    assert resumed["lm loss validation"][6] == tb["lm loss validation"][6]
    assert sorted(resumed.get("mce loss", {})) == list(range(at + 1, 4))  # phase 1 until 3


def _mtp_child(rank, world):
    from tst_megatron.runtime import ParallelConfig, initialize_model_parallel, set_seed
    from tst_megatron.superposition import align_bag_targets, fold_bags

    initialize_model_parallel(ParallelConfig())
    set_seed(3)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, V, (B, S * T + 1), generator=g)
    upstream = torch.randn(B * T * S * S, generator=g) + 0.3
    targets, _ = align_bag_targets(tokens[:, 1:], torch.ones(B, S * T), S)
    bags = fold_bags(tokens[:, :-1], S)
    with_mtp = _hybrid("*E*E/*E", 4, mtp_num_layers=1)
    without = _hybrid("*E*E", 4)
    set_weights(with_mtp)
    main = {k: v for k, v in with_mtp.state_dict().items() if not k.startswith("mtp.")}
    without.load_state_dict(main, strict=True)
    out = {"mtp": sorted(n for n, _ in with_mtp.named_parameters() if n.startswith("mtp."))}
    for phase in (1, 2):
        out[phase] = [_run(m, tokens, upstream, targets, bags, phase) for m in (with_mtp, without)]
    return out


def test_a_hybrid_mtp_block_is_skipped_in_phase_1_and_trains_in_phase_2():
    """``*E*E/*E``: in phase 1 the MTP parameters get an exactly zero gradient and the rest
    the gradients of the same model without MTP (the loss is the same); in phase 2 they
    train."""
    (r,) = run_distributed(_mtp_child, 1)
    assert len(r["mtp"]) > 5, r["mtp"]
    (ce, grads), (ce_plain, grads_plain) = r[1]
    torch.testing.assert_close(ce, ce_plain, rtol=0, atol=0)
    for name in r["mtp"]:
        assert name in grads and torch.count_nonzero(grads[name]) == 0, name
    for name, grad in grads_plain.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=name)
    (_, grads2), _ = r[2]
    assert all(torch.count_nonzero(grads2[name]) > 0 for name in r["mtp"] if "norm" not in name)


@pytest.mark.slow
def test_a_hybrid_with_mtp_trains_it_after_the_switch_only(hybrid_runs):
    """``*E*E/*E`` through the launcher: the model is the HybridModel (its switch checkpoint
    holds the hybrid stack's final norm and the MTP block), MTP's loss is logged in phase 2
    only."""
    from torch.distributed.checkpoint import FileSystemReader

    text, tb, save = hybrid_runs["mtp"]
    assert sorted(tb["mce loss"]) == [1, 2, 3] and sorted(tb["lm loss"]) == [4, 5, 6]
    assert sorted(tb["mtp_1 loss"]) == [4, 5, 6] and all(v > 0 for v in tb["mtp_1 loss"].values())
    names = FileSystemReader(f"{save}/iter_0000003").read_metadata().state_dict_metadata
    assert any(k.startswith("decoder.final_norm.") for k in names), sorted(names)[:20]
    assert any(k.startswith("mtp.layers.0.mtp_model_layer.") for k in names)


def _gpt_line():
    """HYBRID_MOE as the equivalent GPT line: 2 MoE transformer layers for ``*E*E``."""
    argv = list(HYBRID_MOE)
    i = argv.index("--hybrid-layer-pattern")
    argv[i : i + 2] = ["--num-layers", "2"]
    return argv


@pytest.mark.slow
def test_a_gpt_switch_checkpoint_continues_as_the_equivalent_hybrid(tmp_path, hybrid_runs):
    """A GPT MoE's TST switch checkpoint (iteration 3, weights and optimizer) continues under
    the hybrid launcher as ``*E*E`` (megatron-core's load-time translation) with the losses
    the GPT run continues with; a pattern of another GPT layer count is refused in one line,
    and a hybrid checkpoint under the GPT launcher too."""
    from tests.launcher import pretrain_child_keep_going as child
    from tests.launcher import scalars

    gpt, tb = str(tmp_path / "gpt"), str(tmp_path / "tb")
    first = _gpt_line() + ["--save", gpt, "--save-interval", "3"]
    run_distributed(child, 1, runs=[first])
    at_switch = ["--load", gpt, "--ckpt-step", "3"]
    gpt_on = _gpt_line() + at_switch + ["--tensorboard-dir", f"{tb}_gpt"]
    hybrid_on = HYBRID_MOE + at_switch + ["--tensorboard-dir", f"{tb}_hybrid"]
    ((gpt_text,),) = run_distributed(child, 1, runs=[gpt_on])
    ((hybrid_text,),) = run_distributed(child, 1, runs=[hybrid_on], model="hybrid")
    want, got = scalars(f"{tb}_gpt"), scalars(f"{tb}_hybrid")
    assert sorted(got.get("lm loss", {})) == [4, 5, 6], hybrid_text[-3000:]
    for i in (4, 5, 6):
        assert got["lm loss"][i] == pytest.approx(want["lm loss"][i], rel=REL, abs=0), i
    assert got["lm loss validation"][6] == pytest.approx(want["lm loss validation"][6], rel=REL)
    assert "loading a GPT checkpoint into the hybrid model" in hybrid_text
    # another GPT layer count, and the other direction: one line each, before any work
    from tests.unit.test_dry_run import dry

    wrong = dry(HYBRID_MOE[:] + ["--load", gpt, "--hybrid-layer-pattern", "*E*E*E"], model="hybrid")
    errors = [x for x in wrong.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "a GPTModel's of 2 layers" in errors[0], wrong.stderr
    hybrid_checkpoint = hybrid_runs["scratch"][2]
    back = dry(_gpt_line() + ["--load", hybrid_checkpoint])
    errors = [x for x in back.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "saved by a HybridModel run" in errors[0], back.stderr
    assert "examples/pretrain_hybrid_tst.py" in errors[0]
    # the same two with --use-checkpoint-args (the model flags then come from the checkpoint)
    wrong = dry(HYBRID_MOE + ["--load", gpt, "--hybrid-layer-pattern", "*E*E*E",
                              "--use-checkpoint-args"], model="hybrid")  # fmt: skip
    errors = [x for x in wrong.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "a GPTModel's of 2 layers" in errors[0], wrong.stderr
    back = dry(_gpt_line() + ["--load", hybrid_checkpoint, "--use-checkpoint-args"])
    errors = [x for x in back.stderr.splitlines() if x.startswith("error:")]
    assert errors and all("HybridModel" in e for e in errors), back.stderr
    assert any("examples/pretrain_hybrid_tst.py" in e for e in errors), errors


def _export_child(rank, world, *, cases, out_root):
    """1 process: for each ``{name: checkpoint}`` of ``cases``, export its last checkpoint to
    Hugging Face with ``tools/convert_checkpoint.py`` (``(status, stdout, stderr)``) and,
    where that worked, the logits ``[2, 16, V]`` (float64) on :data:`EXPORT_TOKENS` of a
    1-process megatron-core ``HybridModel`` (this project's local hybrid stack spec) built
    from the checkpoint's ``args`` by Megatron-LM's ``hybrid_config_from_args``, its weights
    read by ``dist_checkpointing``."""
    import importlib.util

    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.training.argument_utils import hybrid_config_from_args

    from tst_megatron.conversion.megatron import resolve_checkpoint
    from tst_megatron.models.hybrid import local_hybrid_stack_spec

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location(
        "convert_checkpoint", os.path.join(root, "tools", "convert_checkpoint.py")
    )
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    results = {}
    for name, save in cases.items():
        import contextlib
        import io

        out, err = io.StringIO(), io.StringIO()
        hf_dir = os.path.join(out_root, name)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = tool.main(["export", "--load", save, "--save", hf_dir])
        results[name] = {"cli": (status, out.getvalue(), err.getvalue())}
        if status != 0:
            continue
        path = resolve_checkpoint(save)
        args = one_process_args(dist_checkpointing.load_common_state_dict(path)["args"])
        args.hybrid_layer_pattern = args.hybrid_layer_pattern.replace("|", "")
        try:
            cfg = hybrid_config_from_args(args)
            model = HybridModel(
                config=cfg.transformer,
                hybrid_stack_spec=local_hybrid_stack_spec(cfg.transformer),
                vocab_size=args.padded_vocab_size,
                max_sequence_length=cfg.seq_length,
                hybrid_layer_pattern=cfg.hybrid_layer_pattern,
                share_embeddings_and_output_weights=cfg.share_embeddings_and_output_weights,
                position_embedding_type=cfg.position_embedding_type,
                rotary_base=cfg.rotary_base,
            ).eval()
            state = dist_checkpointing.load({"model": model.sharded_state_dict()}, path)
            model.load_state_dict(state["model"])
            ids = EXPORT_TOKENS
            positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
            with torch.no_grad():
                logits = model(ids, positions, None)[..., : args.vocab_size].double()
            results[name]["logits"] = logits
        finally:
            parallel_state.destroy_model_parallel()
    return results


EXPORT_TOKENS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def exported(hybrid_runs, tmp_path_factory):
    """The Hugging Face exports of the ``*E|*E`` (PP = 2), ``*-*-*-*-`` (RMSNorm, SwiGLU),
    ``*E*E/*E`` (MTP) and ``*E*E`` (LayerNorm) hybrid checkpoints: ``(Hugging Face root,
    {name: {"cli": ..., "logits": ...}})``."""
    out_root = str(tmp_path_factory.mktemp("hybrid_hf"))
    cases = {name: hybrid_runs[name][2] for name in ("export_pp2", "export_dense", "mtp", "one")}
    (results,) = run_distributed(_export_child, 1, cases=cases, out_root=out_root)
    return out_root, results


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, architecture",
    [("export_pp2", "MixtralForCausalLM"), ("export_dense", "LlamaForCausalLM")],
)
def test_a_gpt_shaped_hybrid_exports_to_hugging_face_with_its_logits(exported, name, architecture):
    # *E|*E (saved at PP = 2) is a 2-layer MoE GPT, *-*-*-*- a 4-layer dense one: they export
    # to the GPT families, and transformers' model computes the hybrid model's logits
    transformers = pytest.importorskip("transformers")
    import json

    out_root, results = exported
    status, out, err = results[name]["cli"]
    assert status == 0, err
    hf_dir = os.path.join(out_root, name)
    config = json.load(open(os.path.join(hf_dir, "config.json")))
    assert config["architectures"] == [architecture]
    assert config["num_hidden_layers"] == {"export_pp2": 2, "export_dense": 4}[name]
    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        theirs = model(EXPORT_TOKENS).logits.double()
    ours = results[name]["logits"]
    assert theirs.shape == ours.shape == (2, 16, 128)
    assert ours.abs().max().item() > 0.1  # not a degenerate model
    assert (theirs - ours).abs().max().item() <= 1e-5


@pytest.mark.slow
def test_a_hybrid_the_targets_cannot_hold_is_refused_by_the_export_in_one_line(exported):
    # MTP layers; LayerNorm (the targets use RMSNorm): one error line each, nothing written
    out_root, results = exported
    for name, words in (
        ("mtp", ("--hybrid-layer-pattern *E*E/*E", "multi-token prediction")),
        ("one", ("--normalization LayerNorm", "RMSNorm")),
    ):
        status, out, err = results[name]["cli"]
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert status == 2 and len(lines) == 1, err
        assert all(w in lines[0] for w in words), lines
        assert not os.path.exists(os.path.join(out_root, name))
