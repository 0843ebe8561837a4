"""Model rules: settings megatron-core 0.19 refuses only while building the model, and the
model class each launcher builds: ``examples/pretrain_gpt_tst.py`` a ``GPTModel``
(``pretrain_hybrid.py``'s flags are refused), ``examples/pretrain_hybrid_tst.py`` a
``HybridModel`` (the flags it would ignore, and the layer families this machine cannot run,
are refused)."""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Optional, Sequence

from megatron.core.models.hybrid.hybrid_layer_allocation import get_hybrid_total_layer_count

from tst_megatron.models.family import GPT, HYBRID
from tst_megatron.models.pattern import LAYER_KINDS, HybridPattern
from tst_megatron.training.argv import flag_values

#: Megatron-LM's flags of ``pretrain_hybrid.py``'s ``HybridModel`` (layer pattern, Mamba mixer):
#: a ``GPTModel`` reads none of them. Exact flags, and a prefix.
HYBRID_FLAGS = (
    "--hybrid-layer-pattern",
    "--hybrid-override-pattern",
    "--mtp-hybrid-override-pattern",
    "--is-hybrid-model",
    "--disable-mamba-mem-eff-path",
)
HYBRID_FLAG_PREFIX = "--mamba-"


def hybrid_flag_problems(argv: Sequence[str]) -> list[str]:
    """The ``HybridModel`` flags of the command line ``argv``, as one line: :data:`HYBRID_FLAGS`
    and ``--mamba-*``. A ``GPTModel`` would silently ignore them (Megatron-LM's parser accepts
    them for every model; its ``validate_args`` even resets ``--num-layers`` from a pattern)."""
    flags = [word.split("=", 1)[0] for word in argv if word.startswith("--")]
    hybrid = [f for f in flags if f in HYBRID_FLAGS or f.startswith(HYBRID_FLAG_PREFIX)]
    if not hybrid:
        return []
    return [
        f"{', '.join(dict.fromkeys(hybrid))}: a HybridModel flag (pretrain_hybrid.py's); "
        "this launcher builds pretrain_gpt.py's GPTModel, which would ignore it: launch "
        f"{HYBRID.launcher} for a HybridModel, or drop it"
    ]


_NO_PATTERN = (
    "a HybridModel needs --hybrid-layer-pattern, one symbol per layer (e.g. '*E*E': attention "
    "and MoE layers; it also sets the layer count: --num-layers is not needed), or launch "
    f"{GPT.launcher} for a GPTModel"
)


def hybrid_pattern_argv_problems(argv: Sequence[str]) -> list[str]:
    """The hybrid launcher's line with no layer pattern, or one with no layer before its MTP
    part (``""``, ``"/"``, ``"|"``): megatron-core 0.19.2 answers the first by asking for
    ``--num-layers`` (which a pattern replaces) and the second with a ``ZeroDivisionError``
    in ``TransformerConfig``. Read from the command line as given (the last value counts);
    with ``--use-checkpoint-args`` a missing pattern is :func:`hybrid_pattern_problems`'s."""
    pattern, flag = None, None
    for i, word in enumerate(argv):
        name, eq, value = word.partition("=")
        if name in ("--hybrid-layer-pattern", "--hybrid-override-pattern"):
            flag = name
            pattern = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
    if pattern is None:  # --use-checkpoint-args may bring one: hybrid_pattern_problems
        return [] if "--use-checkpoint-args" in argv else [_NO_PATTERN]
    if not HybridPattern.main_of(pattern).strip():
        if "/" in pattern:
            what = "holds no layer before its MTP part"
        elif pattern.strip():
            what = "holds no layer, only pipeline-stage splits"
        else:
            what = "is empty"
        return [
            f"{flag} {pattern!r} {what}: give one symbol per "
            "layer (* attention, - MLP, E MoE, M Mamba-2, G gated delta net; '|' splits "
            "pipeline stages, '/' starts the MTP part)"
        ]
    return []


#: ``pretrain_gpt.py`` flags a ``HybridModel`` does not read (megatron-core 0.19.2), with what
#: to give instead; refused by the hybrid launcher when set.
GPT_ONLY = {
    "moe_layer_freq": "--moe-layer-freq (a HybridModel places its MoE layers by 'E' in "
    "--hybrid-layer-pattern)",
    "use_rope_scaling": "--use-rope-scaling (HybridModel takes no RoPE scaling)",
    "heterogeneous_layers_config_path": "--heterogeneous-layers-config-path (a GPTModel's)",
    "experimental_attention_variant": "--experimental-attention-variant (a GPTModel's; a "
    "HybridModel names its attention kinds in --hybrid-layer-pattern)",
    "linear_attention_freq": "--linear-attention-freq (a GPTModel's; a HybridModel places "
    "gated delta net layers by 'G' in --hybrid-layer-pattern)",
}


def gpt_only_problems(args) -> list[str]:
    """The ``pretrain_gpt.py`` flags of :data:`GPT_ONLY` set in a hybrid launch, one line each
    (``--moe-layer-freq`` only when not its default 1)."""
    found = []
    for name, flag in GPT_ONLY.items():
        value = getattr(args, name, None)
        if value in (None, False) or (name == "moe_layer_freq" and value == 1):
            continue
        found.append(
            f"{flag}: a GPTModel flag the HybridModel this launcher builds would ignore; "
            f"drop it, or launch {GPT.launcher}"
        )
    return found


def hybrid_pattern_problems(pattern: Optional[HybridPattern], args, device: str) -> list[str]:
    """A hybrid launch's ``--hybrid-layer-pattern`` (``pattern``, the launch's parsed one):
    given; an ``E`` only with ``--num-experts``; each layer kind
    :func:`~tst_megatron.models.hybrid.local_hybrid_stack_spec` does not build, on a CPU (or
    with ``--transformer-impl local``), one line naming what it needs
    (:data:`~tst_megatron.models.pattern.LAYER_KINDS`)."""
    if pattern is None:
        return [_NO_PATTERN]
    found = []
    if pattern.has("E") and not args.num_experts:
        found.append(
            f"--hybrid-layer-pattern {pattern.text} has MoE layers (E): give --num-experts"
        )
    local = device == "cpu" or args.transformer_impl == "local"
    for symbol, kind in LAYER_KINDS.items():
        if local and kind.needs and pattern.has(symbol):
            where = "a CPU run" if device == "cpu" else "--transformer-impl local"
            found.append(
                f"--hybrid-layer-pattern {pattern.text}: {kind.name} layers ({symbol}) need "
                f"{kind.needs}; {where} builds megatron-core's local modules, which have only "
                "attention (*), MLP (-) and MoE (E) layers"
            )
    return found


def missing_packages(pattern: Optional[HybridPattern]) -> list[tuple[str, str]]:
    """``[(symbol, package)]`` of the layer kinds of ``pattern`` whose package
    (:attr:`~tst_megatron.models.pattern.LayerKind.package`) is not installed here."""
    if pattern is None:
        return []
    return [
        (symbol, kind.package)
        for symbol, kind in LAYER_KINDS.items()
        if kind.package and pattern.has(symbol) and importlib.util.find_spec(kind.package) is None
    ]


def hybrid_package_problems(pattern: Optional[HybridPattern], device: str) -> list[str]:
    """In a launch on a GPU: each layer kind of ``pattern`` whose package is not installed here
    (:func:`missing_packages`), one line naming it. A dry run assumes the cluster has them."""
    if device != "cuda":
        return []
    return [
        f"--hybrid-layer-pattern {pattern.text}: {symbol} layers need the {package} "
        "package, which is not installed here"
        for symbol, package in missing_packages(pattern)
    ]


def gated_delta_net_problems(args, device: str, launch: bool) -> list[str]:
    """``--experimental-attention-variant gated_delta_net`` (a GPT model's GDN layers,
    Qwen3-Next style): megatron-core 0.19.2 builds them from ``fla``'s Triton kernels, which
    need a GPU; a launch on a GPU without ``fla`` installed is one line too (a dry run assumes
    the cluster has it)."""
    if getattr(args, "experimental_attention_variant", None) != "gated_delta_net":
        return []
    flag = "--experimental-attention-variant gated_delta_net"
    if device == "cpu":
        return [f"{flag}: gated delta net layers need the fla package's Triton kernels, a GPU"]
    if launch and importlib.util.find_spec("fla") is None:
        return [
            f"{flag}: gated delta net layers need the fla package (flash-linear-attention), "
            "which is not installed here"
        ]
    return []


def model_problems(args) -> list[str]:
    """Model settings megatron-core 0.19 refuses only while building the model: heads not
    divisible by ``--num-query-groups``, a shared expert with biases, a ``--moe-layer-freq``
    pattern whose length is not ``--num-layers``, ``--moe-router-topk`` above
    ``--num-experts``."""
    problems = []
    if args.group_query_attention and args.num_attention_heads % args.num_query_groups:
        problems.append(
            f"--num-attention-heads {args.num_attention_heads} is not divisible by "
            f"--num-query-groups {args.num_query_groups}"
        )
    if args.moe_shared_expert_intermediate_size and args.add_bias_linear:
        problems.append(
            "--moe-shared-expert-intermediate-size: megatron-core's shared experts have no "
            "biases; add --disable-bias-linear"
        )
    experts = args.num_experts or 0
    freq = args.moe_layer_freq
    if experts and isinstance(freq, list) and len(freq) != args.num_layers:
        problems.append(
            f"--moe-layer-freq gives a pattern of {len(freq)} layers for --num-layers "
            f"{args.num_layers}: give one 0/1 entry per layer"
        )
    if experts and args.moe_router_topk > experts:
        problems.append(
            f"--moe-router-topk {args.moe_router_topk} is more than --num-experts {experts}"
        )
    return problems


def problems(launch) -> list[str]:
    """The model rules of every family, then those of the launch's own
    (:data:`FAMILY_RULES`)."""
    found = model_problems(launch.args)
    found += gated_delta_net_problems(launch.args, launch.device, launch.launch)
    return found + [
        line for rule in FAMILY_RULES[launch.family.name].launch for line in rule(launch)
    ]


def gpt_problems(launch) -> list[str]:
    """The GPT launcher's own rule: a ``--hybrid-layer-pattern`` from the checkpoint's
    arguments (``--use-checkpoint-args``) is a ``HybridModel`` run."""
    if launch.pattern is None:
        return []
    return [
        f"--hybrid-layer-pattern {launch.pattern.text} (from the checkpoint's "
        "arguments): a HybridModel run; this launcher builds a GPTModel: launch "
        f"{HYBRID.launcher}"
    ]


def hybrid_problems(launch) -> list[str]:
    """The hybrid launcher's own rules: the pattern (:func:`hybrid_pattern_problems`), the
    kernels' packages in a launch, MTP, the pipeline stages, and the settings megatron-core
    0.19.2's ``HybridModel`` does not take."""
    found = hybrid_pattern_problems(launch.pattern, launch.args, launch.device)
    if launch.launch:
        found += hybrid_package_problems(launch.pattern, launch.device)
    found += hybrid_mtp_problems(launch.args, launch.pattern)
    found += hybrid_stage_problems(launch.args, launch.pattern)
    if launch.args.overlap_moe_expert_parallel_comm:
        found.append(
            "--overlap-moe-expert-parallel-comm: megatron-core 0.19.2's HybridModel builds "
            "no schedule plan for its combined 1F1B (GPTModel does: launch "
            f"{GPT.launcher} for a GPT-shaped model, or drop the flag)"
        )
    if launch.args.transformer_impl == "inference_optimized":
        found.append(
            "--transformer-impl inference_optimized: megatron-core's inference stack spec; "
            "this training launcher builds the training specs (give transformer_engine or "
            "local)"
        )
    return found + gpt_only_problems(launch.args)


def hybrid_stage_problems(args, parsed: Optional[HybridPattern]) -> list[str]:
    """A pattern without ``|`` whose layers do not split evenly over PP (megatron-core's
    ``select_pipeline_segment`` raises while building the model), and a pipeline rank without
    MoE layers in a hybrid MoE run.

    Workaround: megatron-core 0.19.2's MoE metrics (``training_log``:
    ``MoEMetricsTracker.report`` with ``force_initialize``) size that rank's tensors by the
    pattern's MoE layer count while the MoE ranks size theirs by ``num_layers``, and the
    all-reduce over the pipeline group hangs or fails at the first log line (found on CPU:
    ``*|E|*|E`` at PP 2)."""
    pp = args.pipeline_model_parallel_size
    if parsed is None:
        return []
    pattern, main, piped = parsed.text, parsed.main, len(parsed.segments) > 1
    if pp < 2 or (
        not piped
        and (args.decoder_first_pipeline_num_layers or args.decoder_last_pipeline_num_layers)
    ):
        return []  # the first/last stage sizes are not modelled (megatron-core checks them)
    if not piped and len(main) % pp:
        return [
            f"--hybrid-layer-pattern {pattern}: {len(main)} layers do not split evenly over "
            f"--pipeline-model-parallel-size {pp} (megatron-core raises while building the "
            "model); give the stages with '|'"
        ]
    if "E" not in main:
        return []
    empty = [r for r, layers in enumerate(parsed.stage_layers(pp)) if "E" not in layers]
    if not empty:
        return []
    where = "its '|' segments" if piped else "its share of the layers (or split with '|')"
    return [
        f"--hybrid-layer-pattern {pattern} at --pipeline-model-parallel-size {pp} leaves "
        f"pipeline rank(s) {', '.join(map(str, empty))} without MoE (E) layers: megatron-core "
        "0.19's MoE logging then all-reduces tensors of another size there and the run hangs "
        f"at its first log line; give every rank an E layer in {where}"
    ]


def hybrid_mtp_problems(args, parsed: Optional[HybridPattern]) -> list[str]:
    """``--mtp-num-layers`` on a ``HybridModel`` without an MTP pattern: Megatron-LM 0.19 only
    warns and builds no MTP layer."""
    if not getattr(args, "mtp_num_layers", None) or parsed is None or parsed.mtp_depths:
        return []
    return [
        f"--mtp-num-layers {args.mtp_num_layers} without an MTP pattern: a HybridModel "
        "builds its MTP layers from '/' in --hybrid-layer-pattern (e.g. '*E*E/*E'), so "
        "this run would have none"
    ]


def hybrid_notes(launch) -> list[str]:
    """Flags a ``HybridModel`` run gives that Megatron-LM 0.19.2's ``validate_args`` replaces by
    what the pattern says (it only warns): ``--num-layers`` other than the pattern's layer
    count, ``--mtp-num-layers`` other than its MTP depths."""
    parsed = launch.pattern
    if parsed is None:
        return []
    lines, pattern = [], parsed.text
    layers = get_hybrid_total_layer_count(pattern)
    given = flag_values(launch.argv, "--num-layers").num_layers
    if given is not None and given != str(layers):
        lines.append(
            f"--num-layers {given} is not used: --hybrid-layer-pattern '{pattern}' has {layers} "
            "layers, and Megatron-LM takes the pattern's count"
        )
    given = flag_values(launch.argv, "--mtp-num-layers").mtp_num_layers
    if parsed.mtp_depths and given is not None and given != str(parsed.mtp_depths):
        lines.append(
            f"--mtp-num-layers {given} is not used: --hybrid-layer-pattern '{pattern}' has "
            f"{parsed.mtp_depths} MTP depth(s), and Megatron-LM takes the pattern's"
        )
    return lines


def notes(launch) -> list[str]:
    """The family's notes (:data:`FAMILY_RULES`), and that
    megatron-core 0.19's ``global_aux_loss`` counts tokens over DP and micro-batches (its value
    depends on the layout)."""
    args = launch.args
    lines = [line for note in FAMILY_RULES[launch.family.name].notes for line in note(launch)]
    kinds = args.moe_router_load_balancing_type
    kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
    if not (args.num_experts and "global_aux_loss" in kinds):
        return lines
    return lines + [
        "--moe-router-load-balancing-type global_aux_loss: megatron-core counts the tokens "
        "per expert over the data-parallel ranks and micro-batches of a step, so its value "
        "and gradient change with DP and --micro-batch-size (the same run under another "
        "layout trains differently; aux_loss does not). TST keeps its meaning: a phase-1 "
        "bag counts as one token"
    ]


@dataclasses.dataclass(frozen=True)
class FamilyRules:
    """The launch rules of one model family.

    Attributes:
        argv: rules of the command line as given (``argv`` -> one line per problem), before
            Megatron-LM parses it.
        launch: rules of the checked launch (``Launch`` -> one line per problem).
        notes: its ``note:`` lines (``Launch`` -> lines).
    """

    argv: tuple = ()
    launch: tuple = ()
    notes: tuple = ()


#: Each family's own rules, by :attr:`~tst_megatron.models.family.ModelFamily.name`.
FAMILY_RULES = {
    GPT.name: FamilyRules(argv=(hybrid_flag_problems,), launch=(gpt_problems,)),
    HYBRID.name: FamilyRules(
        argv=(hybrid_pattern_argv_problems,), launch=(hybrid_problems,), notes=(hybrid_notes,)
    ),
}


def family_argv_problems(family, argv: Sequence[str]) -> list[str]:
    """Every :attr:`FamilyRules.argv` line of ``family`` (a
    :class:`~tst_megatron.models.family.ModelFamily`) for ``argv``."""
    return [line for rule in FAMILY_RULES[family.name].argv for line in rule(argv)]
