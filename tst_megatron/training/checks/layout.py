"""Layout rules (TP, CP, PP, virtual PP, EP, expert TP, sequence parallelism) that
megatron-core 0.19 enforces only while building the model or inside the first training step."""

from __future__ import annotations


def parallel_problems(args, config, plan) -> list[str]:
    """Rules megatron-core enforces only inside the first training step:

    - sequence parallelism: ``--seq-length`` / CP divisible by TP (both TST phases run
      ``--seq-length`` positions);
    - the interleaved pipeline, for each global batch of M micro-batches the run reaches
      (``plan.reached_batches``, and the validation batch) and group size N
      (``config.microbatch_group_size_per_vp_stage``, default PP): ``PP <= N <= M`` and
      ``M mod N`` 0 or ``>= PP`` (megatron-core 0.19's
      ``forward_backward_pipelining_with_interleaving`` raises otherwise).
    """
    problems = []
    tp, cp, t = args.tensor_model_parallel_size, args.context_parallel_size, args.seq_length
    if args.sequence_parallel and tp > 1 and t % (cp * tp):
        problems.append(
            f"--seq-length {t} with --sequence-parallel: each rank's {t // cp if t % cp == 0 else t / cp:g} "
            f"positions (--seq-length / CP {cp}) must be divisible by "
            f"--tensor-model-parallel-size {tp}; give a --seq-length divisible by {cp * tp}"
        )
    pp, vpp = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size
    if pp > 1 and vpp and vpp > 1:
        group = getattr(config, "microbatch_group_size_per_vp_stage", None) or pp
        per_step = args.micro_batch_size * args.data_parallel_size
        batches = {batch for _, batch in plan.reached_batches}
        if getattr(args, "eval_iters", 0):
            batches.add(getattr(args, "eval_global_batch_size", None) or args.global_batch_size)
        for batch in sorted(batches):
            m = batch // per_step
            if not pp <= group <= m or 0 < m % group < pp:
                problems.append(
                    f"the interleaved pipeline (PP {pp}, {vpp} virtual stages) with global batch "
                    f"{batch} = {m} micro-batches of {args.micro_batch_size} x DP "
                    f"{args.data_parallel_size}: megatron-core needs PP {pp} <= "
                    f"--microbatch-group-size-per-virtual-pipeline-stage {group} <= {m} and "
                    f"{m} mod {group} = 0 or >= {pp}; change --global-batch-size or the group size"
                )
    return problems


def expert_layout_problems(args) -> list[str]:
    """MoE with TP > 1 and no ``--sequence-parallel`` (megatron-core's MoE layer refuses it in
    the first step), and a world size that expert TP x EP x PP does not divide."""
    problems = []
    if args.num_experts and args.tensor_model_parallel_size > 1 and not args.sequence_parallel:
        problems.append(
            "MoE with --tensor-model-parallel-size > 1 needs --sequence-parallel (megatron-core's "
            "MoE layer refuses it in the first training step)"
        )
    etp = args.expert_tensor_parallel_size or args.tensor_model_parallel_size
    expert_model = etp * args.expert_model_parallel_size * args.pipeline_model_parallel_size
    if args.world_size % expert_model:
        problems.append(
            f"world size {args.world_size} is not divisible by --expert-tensor-parallel-size "
            f"{etp} x --expert-model-parallel-size {args.expert_model_parallel_size} x "
            f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size}"
        )
    return problems


def problems(launch) -> list[str]:
    """The layout rules of a :class:`~tst_megatron.training.checks.Launch`."""
    return parallel_problems(launch.args, launch.config, launch.plan) + expert_layout_problems(
        launch.args
    )
