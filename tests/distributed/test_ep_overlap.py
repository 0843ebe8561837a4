"""The expert-parallel all-to-all overlap (``--overlap-moe-expert-parallel-comm``: megatron-core's
combined 1F1B, which runs the model's *schedule plan*) with TST's forward steps, on 2 gloo
processes at EP = 2 (alltoall dispatcher): every loss and gradient equals the same steps run
without the overlap, bitwise, in phase 1 (bag embedding as ``decoder_input``, the multi-hot
loss in the plan's post-process node) and in phase 2, with and without multi-token
prediction (phase 1 drops the plan's MTP layer nodes and the MTP-only parameters get an
exactly zero gradient, as without the overlap).

Megatron-core 0.19.2 runs the overlap only for bf16/fp16 models (``TransformerConfig``), which
a CPU cannot train: the model is built in float32 and the flag set on its config afterwards,
so that ``forward_backward_no_pipelining`` takes the combined-1F1B path. The CPU runtime
redirects the schedule's CUDA streams and events (``tst_megatron/runtime/cpu.py``). The launch
line with the overlap passes the launcher's checks as a CUDA run
(``tests/unit/test_dry_run.py``); what only a GPU can show (two streams really overlapping,
bf16) is the GPU check's to run.
"""

import pytest
import torch

from tests.distributed import test_gpt_tst as gpt
from tests.distributed.harness import run_distributed

MICRO_BATCHES = 2


def _children(rank, world, *, runs, pp=1):
    """Each of ``runs`` (keyword dicts of :func:`_run`) in this process, one after another,
    on one EP=2 parallel state (one spawn for a test's plain and overlapped runs); ``pp=2``:
    PP=2 with 2 virtual stages per rank (4 processes)."""
    from tst_megatron.runtime import ParallelConfig, initialize_model_parallel

    initialize_model_parallel(
        ParallelConfig(
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=2 if pp > 1 else None,
            expert_model_parallel_size=2,
        )
    )
    return [_run(rank, **run) for run in runs]


def _pair(**run):
    """``(plain, overlapped)`` per rank: the same run without and with the overlap."""
    ranks = run_distributed(_children, 2, runs=[dict(run, overlap=False), dict(run, overlap=True)])
    return [(results[0], results[1]) for results in ranks]


def _chunks(config, *, mtp):
    """The model's chunks on this rank, weights keyed by their name in the whole model (so
    every run holds the same model): one chunk, or one per virtual stage (``config``'s
    ``virtual_pipeline_model_parallel_size``)."""
    from megatron.core import parallel_state as ps

    from tests.distributed.harness import build_gpt_model
    from tst_megatron.models.gpt import TSTGPTModel, gpt_block_spec, local_mtp_block_spec

    if mtp:
        config.mtp_num_layers = 1
        model = TSTGPTModel(
            config=config,
            transformer_layer_spec=gpt_block_spec(config),
            vocab_size=gpt.V,
            max_sequence_length=gpt.T * gpt.S,
            parallel_output=True,
            position_embedding_type="rope",
            mtp_block_spec=local_mtp_block_spec(config),
        )
        return [model], gpt._set_weights(model, 0, ps.get_expert_model_parallel_rank())
    chunks, names = [], {}
    stages = config.virtual_pipeline_model_parallel_size
    for vp in range(stages or 1):
        vp_stage = vp if stages else None
        model = build_gpt_model(
            config,
            vocab_size=gpt.V,
            max_sequence_length=gpt.T * gpt.S,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            vp_stage=vp_stage,
        )
        chunk = gpt._set_weights(
            model,
            ps.get_pipeline_model_parallel_rank() + 2 * vp,
            ps.get_expert_model_parallel_rank(),
        )
        names.update({(vp, n): f"{vp}:{g}" for n, g in chunk.items()})
        chunks.append(model)
    if not stages:
        names = {n: g for (_, n), g in names.items()}
    return chunks, names


def _grads(chunks, names):
    if len(chunks) == 1:
        return {
            names[n]: p.grad.clone() for n, p in chunks[0].named_parameters() if p.grad is not None
        }
    return {
        names[vp, n]: p.grad.clone()
        for vp, model in enumerate(chunks)
        for n, p in model.named_parameters()
        if p.grad is not None
    }


def _run(
    rank, *, overlap, phase, mtp, delay_wgrad=False, switch=False, resume=False, pp=1,
    loss_chunks=1,
):  # fmt: skip
    """Plain or overlapped steps of one TST phase (``switch``: a phase-1 step, an SGD update,
    then the ``phase`` step; ``resume``: the model is built again from its state dict before
    that step, as a restarted run loads it): the losses and the gradients by global name."""
    import copy
    import dataclasses

    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from tst_megatron.loop.forward import make_phase1_step, make_phase2_step
    from tst_megatron.runtime import set_seed

    set_seed(7)
    config = gpt._config(1, pp, 2, "alltoall")
    if pp > 1:  # Megatron-LM's layout for an interleaved PP=2: p2p overlapped, not batched
        config = dataclasses.replace(
            config,
            num_layers=2 * gpt.LAYERS,
            virtual_pipeline_model_parallel_size=2,
            overlap_p2p_comm=True,
            batch_p2p_comm=False,
        )
    if delay_wgrad:  # validated as a bf16 model with the overlap (megatron-core's rule), in fp32
        config = dataclasses.replace(
            config, bf16=True, overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True
        )
        config.bf16 = False
    chunks, names = _chunks(config, mtp=mtp)
    if loss_chunks > 1:  # --tst-loss-chunks: the head in chunks, counted
        from tst_megatron.models import seams

        for model in chunks:
            seams.enable_loss_chunks(model, loss_chunks)
        calls, real = [], seams.chunked_output_cross_entropy
        seams.chunked_output_cross_entropy = lambda *a, **k: calls.append(1) or real(*a, **k)
    # megatron-core refuses the flag for a float32 model (see the module docstring)
    config.overlap_moe_expert_parallel_comm = overlap
    micro_batches = MICRO_BATCHES * pp
    dp_rank = ps.get_data_parallel_rank()

    def batches(phase):
        for i in range(micro_batches):
            tokens, labels, loss_mask = gpt._batch(
                2 * i + dp_rank + 4 * micro_batches * (phase == 2)
            )
            length = gpt.S * gpt.T if phase == 1 else gpt.T
            yield {
                "tokens": tokens[:, :length],
                "labels": labels[:, :length],
                "loss_mask": loss_mask[:, :length],
                "position_ids": torch.arange(length).expand(gpt.B, length),
            }

    def run(phase):
        step = make_phase1_step(bag_size=gpt.S, weighting="uniform") if phase == 1 else None
        losses = get_forward_backward_func()(
            forward_step_func=step or make_phase2_step(),
            data_iterator=[batches(phase) for _ in chunks] if pp > 1 else batches(phase),
            model=chunks,
            num_microbatches=micro_batches,
            seq_length=gpt.T,
            micro_batch_size=gpt.B,
            forward_only=False,
        )
        return [d["mce loss" if phase == 1 else "lm loss"] for d in losses]

    losses = []
    if switch:  # a phase-1 step, a plain SGD update, then the phase-2 step: the switch
        losses = run(1)
        with torch.no_grad():
            for model in chunks:
                for p in model.parameters():
                    if p.grad is not None:
                        p.sub_(0.5 * p.grad)
                        p.grad = None
    if resume:  # a restart: fresh chunks (new schedule plans, streams) loading the state
        states = [copy.deepcopy(m.state_dict()) for m in chunks]
        set_seed(11)  # another initialisation, which the load overwrites
        chunks, names = _chunks(config, mtp=mtp)
        for model, state in zip(chunks, states):
            model.load_state_dict(state)
    losses += run(phase)
    result = {"losses": losses, "grads": _grads(chunks, names)}
    if loss_chunks > 1:
        seams.chunked_output_cross_entropy = real
        result["chunked calls"] = len(calls)
    return result


@pytest.mark.slow
@pytest.mark.parametrize("phase", [1, 2])
@pytest.mark.parametrize("mtp", [False, True], ids=["", "mtp"])
def test_the_all_to_all_overlap_equals_the_plain_schedule(phase, mtp):
    for rank, (a, b) in enumerate(_pair(phase=phase, mtp=mtp)):
        assert len(a["losses"]) == MICRO_BATCHES
        for x, y in zip(a["losses"], b["losses"]):
            assert torch.equal(x, y), (rank, x, y)
        assert a["grads"].keys() == b["grads"].keys() and a["grads"]
        for name, grad in a["grads"].items():
            if mtp and phase == 2 and name == "embedding.word_embeddings.weight":
                # the main input's and MTP's embedding gradients, summed in another order
                torch.testing.assert_close(b["grads"][name], grad, rtol=1e-6, atol=1e-7)
                continue
            assert torch.equal(grad, b["grads"][name]), (rank, name)
        if mtp and phase == 1:  # idle in phase 1 (exactly zero), with or without the overlap
            idle = [n for n in b["grads"] if n.startswith("mtp.")]
            assert idle and all(not b["grads"][n].any() for n in idle)
        if mtp and phase == 2:  # and trained in phase 2
            assert any(b["grads"][n].any() for n in b["grads"] if n.startswith("mtp."))


@pytest.mark.slow
def test_the_overlap_with_the_chunked_head_equals_the_plain_schedule_and_the_unchunked_head():
    """``--tst-loss-chunks 3``: the plan's post-process node (which calls the model's
    ``_postprocess``) runs the chunked head; bitwise the plain schedule's, in both phases,
    and the unchunked head's to float32 round-off."""
    runs = [
        dict(overlap=overlap, phase=phase, mtp=False, loss_chunks=chunks)
        for phase in (1, 2)
        for overlap, chunks in ((False, 1), (False, 3), (True, 3))
    ]
    for rank, results in enumerate(run_distributed(_children, 2, runs=runs)):
        for phase, (unchunked, plain, overlapped) in zip((1, 2), zip(*[iter(results)] * 3)):
            assert plain["chunked calls"] == overlapped["chunked calls"] == MICRO_BATCHES
            assert all(torch.equal(x, y) for x, y in zip(plain["losses"], overlapped["losses"]))
            for name, grad in plain["grads"].items():
                assert torch.equal(grad, overlapped["grads"][name]), (rank, phase, name)
                torch.testing.assert_close(grad, unchunked["grads"][name], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(plain["losses"], unchunked["losses"], rtol=1e-6, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("phase", [1, 2])
def test_delayed_weight_gradients_with_the_overlap_equal_the_plain_schedule(phase):
    """``--delay-wgrad-compute`` (every large-MoE recipe pairs it with the overlap): the same
    numbers. On the local spec the delay changes little (Transformer Engine's layers are where
    weight gradients really wait: not run here)."""
    ranks = run_distributed(
        _children,
        2,
        runs=[
            dict(overlap=False, phase=phase, mtp=False),
            dict(overlap=True, phase=phase, mtp=False, delay_wgrad=True),
        ],
    )
    for rank, (a, b) in enumerate(ranks):
        assert all(torch.equal(x, y) for x, y in zip(a["losses"], b["losses"]))
        assert a["grads"].keys() == b["grads"].keys()
        for name, grad in a["grads"].items():
            assert torch.equal(grad, b["grads"][name]), (rank, name)


@pytest.mark.slow
def test_the_all_to_all_overlap_equals_the_plain_schedule_through_the_switch():
    """A phase-1 step, an update, then a phase-2 step (the switch, at megatron-core's level:
    the launcher picks the step function by iteration, the plan is built per micro-batch),
    the overlapped run restarted between the update and the phase-2 step (its model built
    again and loaded from the state dict: no state of the overlap's survives a restart):
    every loss and the phase-2 gradients bitwise against the uninterrupted plain run."""
    ranks = run_distributed(
        _children,
        2,
        runs=[
            dict(overlap=False, phase=2, mtp=False, switch=True),
            dict(overlap=True, phase=2, mtp=False, switch=True, resume=True),
        ],
    )
    for rank, (a, b) in enumerate(ranks):
        assert len(a["losses"]) == 2 * MICRO_BATCHES
        assert all(torch.equal(x, y) for x, y in zip(a["losses"], b["losses"]))
        for name, grad in a["grads"].items():
            assert torch.equal(grad, b["grads"][name]), (rank, name)


@pytest.mark.slow
def test_the_all_to_all_overlap_with_virtual_pipeline_stages_equals_the_plain_schedule():
    """PP=2 with 2 virtual stages per rank and EP=2 (4 processes: megatron-core's overlap
    needs VPP whenever PP > 1), the interleaved schedule's combined 1F1B against the plain
    interleaved schedule, phase 1 (the bag embedding on the first virtual stage, the loss on
    the last) and phase 2: every loss and gradient bitwise, on every rank."""
    runs = [dict(overlap=o, phase=p, mtp=False, pp=2) for p in (1, 2) for o in (False, True)]
    ranks = run_distributed(_children, 4, runs=runs, pp=2)
    for rank, (a1, b1, a2, b2) in enumerate(ranks):
        for a, b in ((a1, b1), (a2, b2)):
            # the last stage (ranks 2, 3) scores 2 * MICRO_BATCHES micro-batches
            assert len(a["losses"]) == (2 * MICRO_BATCHES if rank >= 2 else 0)
            assert all(torch.equal(x, y) for x, y in zip(a["losses"], b["losses"]))
            assert a["grads"].keys() == b["grads"].keys() and len(a["grads"]) > 10
            for name, grad in a["grads"].items():
                assert torch.equal(grad, b["grads"][name]), (rank, name)
