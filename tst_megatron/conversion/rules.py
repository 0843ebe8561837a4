"""The Megatron <-> Hugging Face weight mapping, as data.

Each :class:`Rule` pairs one tensor of a megatron-core ``GPTModel`` state dict (the names of
a 1-process model built with the local spec: ``decoder.layers.3.self_attention.linear_qkv.weight``)
with the Hugging Face tensor(s) it holds, and names the layout that relates them:

- ``copy``: the same tensor.
- ``qkv``: megatron-core's fused ``linear_qkv`` ``[G*(Q/G+2)*d, h]``, grouped per KV group
  ``g`` as ``[q heads of g (Q/G*d rows), k_g (d rows), v_g (d rows)]`` (megatron-core
  ``SelfAttention.get_query_key_value_tensors``) <-> ``q_proj [Q*d, h]``, ``k_proj [G*d, h]``,
  ``v_proj [G*d, h]``.
- ``gate_up``: ``linear_fc1`` of a SwiGLU MLP ``[2*I, h]`` = ``cat(gate, up)`` (megatron-core
  ``MLP`` with ``gated_linear_unit``: ``silu(x[:I]) * x[I:]``) <-> ``gate_proj``/``w1`` and
  ``up_proj``/``w3`` ``[I, h]``.
- ``vocab``: embedding or output rows ``[V_padded, h]`` <-> ``[V, h]``: the padding rows
  (Megatron's ``--make-vocab-size-divisible-by``) are dropped on export, zero on import.

``{L}`` stands for a layer index and ``{E}`` for an expert index. Where an architecture
differs (router and expert names, qk-layernorm, dense layers) it is a different rule set,
not a branch in the conversion code.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Dict, Iterable, List, Mapping, Tuple

import torch

LAYOUTS = ("copy", "qkv", "gate_up", "vocab")


@dataclasses.dataclass(frozen=True)
class Rule:
    """One Megatron tensor and the Hugging Face tensor(s) it corresponds to."""

    megatron: str
    """Megatron name pattern, e.g. ``decoder.layers.{L}.mlp.router.weight``."""
    hf: Tuple[str, ...]
    """Hugging Face name pattern(s), in the order the layout splits/concatenates them."""
    layout: str = "copy"
    """One of :data:`LAYOUTS`."""

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}")


def _layer(megatron: str, *hf: str, layout: str = "copy") -> Rule:
    return Rule(
        "decoder.layers.{L}." + megatron, tuple("model.layers.{L}." + h for h in hf), layout
    )


EMBEDDING_RULES = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    Rule("output_layer.weight", ("lm_head.weight",), "vocab"),  # absent when tied
)
ATTENTION_RULES = (
    _layer("input_layernorm.weight", "input_layernorm.weight"),
    _layer(
        "self_attention.linear_qkv.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        layout="qkv",
    ),
    _layer("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
    _layer("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
)
QK_NORM_RULES = (
    _layer("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
    _layer("self_attention.k_layernorm.weight", "self_attn.k_norm.weight"),
)
DENSE_MLP_RULES = (
    _layer("mlp.linear_fc1.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", layout="gate_up"),
    _layer("mlp.linear_fc2.weight", "mlp.down_proj.weight"),
)
_EXPERT = "mlp.experts.local_experts.{E}."
QWEN3_MOE_RULES = (
    _layer("mlp.router.weight", "mlp.gate.weight"),
    _layer(
        _EXPERT + "linear_fc1.weight",
        "mlp.experts.{E}.gate_proj.weight",
        "mlp.experts.{E}.up_proj.weight",
        layout="gate_up",
    ),
    _layer(_EXPERT + "linear_fc2.weight", "mlp.experts.{E}.down_proj.weight"),
)
MIXTRAL_MOE_RULES = (
    _layer("mlp.router.weight", "block_sparse_moe.gate.weight"),
    _layer(
        _EXPERT + "linear_fc1.weight",
        "block_sparse_moe.experts.{E}.w1.weight",
        "block_sparse_moe.experts.{E}.w3.weight",
        layout="gate_up",
    ),
    _layer(_EXPERT + "linear_fc2.weight", "block_sparse_moe.experts.{E}.w2.weight"),
)


@dataclasses.dataclass(frozen=True)
class Architecture:
    """A Hugging Face target: its names, and which Megatron settings it can hold."""

    name: str
    """Display name."""
    model_type: str
    """``config.json`` ``model_type``."""
    hf_class: str
    """``architectures[0]`` in ``config.json``."""
    qk_layernorm: bool
    """Whether the architecture normalises queries and keys (it must match the model)."""
    moe: bool
    """Whether it has routed experts."""
    rules: Tuple[Rule, ...]


ARCHITECTURES = {
    a.model_type: a
    for a in (
        Architecture(
            "Qwen3-MoE",
            "qwen3_moe",
            "Qwen3MoeForCausalLM",
            True,
            True,
            EMBEDDING_RULES + ATTENTION_RULES + QK_NORM_RULES + DENSE_MLP_RULES + QWEN3_MOE_RULES,
        ),  # dense layers: Qwen3-MoE's mlp_only_layers
        Architecture(
            "Mixtral",
            "mixtral",
            "MixtralForCausalLM",
            False,
            True,
            EMBEDDING_RULES + ATTENTION_RULES + MIXTRAL_MOE_RULES,
        ),
        Architecture(
            "Qwen3",
            "qwen3",
            "Qwen3ForCausalLM",
            True,
            False,
            EMBEDDING_RULES + ATTENTION_RULES + QK_NORM_RULES + DENSE_MLP_RULES,
        ),
        Architecture(
            "Llama",
            "llama",
            "LlamaForCausalLM",
            False,
            False,
            EMBEDDING_RULES + ATTENTION_RULES + DENSE_MLP_RULES,
        ),
    )
}


def architecture_for(*, moe: bool, qk_layernorm: bool) -> Architecture:
    """The target for a model with/without experts and qk-layernorm (each pair has one)."""
    for arch in ARCHITECTURES.values():
        if arch.moe == moe and arch.qk_layernorm == qk_layernorm:
            return arch
    raise AssertionError("unreachable: every combination has a target")


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The sizes the layouts need."""

    num_attention_heads: int
    """Q: query heads."""
    num_query_groups: int
    """G: key/value heads."""
    head_dim: int
    """d."""
    vocab_size: int
    """V: real vocabulary (Hugging Face rows)."""
    padded_vocab_size: int
    """Megatron rows (>= V)."""


def _regex(pattern: str) -> re.Pattern:
    text = re.escape(pattern).replace(r"\{L\}", r"(?P<L>\d+)").replace(r"\{E\}", r"(?P<E>\d+)")
    return re.compile(text + r"\Z")


def _fill(pattern: str, groups: Mapping[str, str]) -> str:
    return pattern.replace("{L}", groups.get("L", "{L}")).replace("{E}", groups.get("E", "{E}"))


def _match(rules: Iterable[Rule], name: str, side: str):
    for rule in rules:
        found = _regex(getattr(rule, side)).match(name)
        if found:
            return rule, found.groupdict()
    return None, None


def _to_hf(rule: Rule, tensor: torch.Tensor, shapes: Shapes) -> List[torch.Tensor]:
    if rule.layout == "copy":
        return [tensor]
    if rule.layout == "vocab":
        return [tensor[: shapes.vocab_size]]
    if rule.layout == "gate_up":
        gate, up = torch.chunk(tensor, 2, dim=0)
        return [gate, up]
    q, g, d = shapes.num_attention_heads, shapes.num_query_groups, shapes.head_dim
    grouped = tensor.reshape(g, q // g + 2, d, tensor.shape[-1])
    return [
        grouped[:, : q // g].reshape(q * d, -1),
        grouped[:, q // g].reshape(g * d, -1),
        grouped[:, q // g + 1].reshape(g * d, -1),
    ]


def _to_megatron(rule: Rule, parts: List[torch.Tensor], shapes: Shapes) -> torch.Tensor:
    if rule.layout == "copy":
        return parts[0]
    if rule.layout == "vocab":
        (rows,) = parts
        pad = rows.new_zeros(shapes.padded_vocab_size - rows.shape[0], rows.shape[1])
        return torch.cat([rows, pad])
    if rule.layout == "gate_up":
        return torch.cat(parts)
    q, g, d = shapes.num_attention_heads, shapes.num_query_groups, shapes.head_dim
    query, key, value = parts
    h = query.shape[-1]
    return torch.cat(
        [query.reshape(g, q // g, d, h), key.reshape(g, 1, d, h), value.reshape(g, 1, d, h)], dim=1
    ).reshape(-1, h)


def _listing(names: Iterable[str], limit: int = 12) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def megatron_to_hf(
    state: Mapping[str, torch.Tensor], arch: Architecture, shapes: Shapes
) -> Dict[str, torch.Tensor]:
    """Rename and re-lay-out every tensor of a 1-process megatron-core ``GPTModel`` state dict.

    Args:
        state: ``{megatron name: tensor}``; ``_extra_state`` entries and non-tensors ignored.
        arch: the target (:data:`ARCHITECTURES`).
        shapes: head and vocabulary sizes for the ``qkv`` and ``vocab`` layouts.

    Returns:
        ``{hf name: contiguous tensor}`` (same dtypes; views are cloned).

    Raises:
        ValueError: some Megatron tensors have no place in ``arch`` (listing their names).
    """
    out, unplaced = {}, []
    for name, tensor in state.items():
        if name.endswith("_extra_state") or not isinstance(tensor, torch.Tensor):
            continue
        rule, groups = _match(arch.rules, name, "megatron")
        if rule is None:
            unplaced.append(name)
            continue
        for pattern, part in zip(rule.hf, _to_hf(rule, tensor, shapes)):
            out[_fill(pattern, groups)] = part.contiguous().clone()
    if unplaced:
        raise ValueError(
            f"{arch.name} has no tensor for these Megatron weights: {_listing(unplaced)}"
        )
    return out


def hf_to_megatron(
    hf_state: Mapping[str, torch.Tensor],
    expected: Mapping[str, torch.Size],
    arch: Architecture,
    shapes: Shapes,
) -> Dict[str, torch.Tensor]:
    """Build the Megatron state dict ``expected`` (names -> shapes of the target model) from
    Hugging Face tensors.

    Returns:
        ``{megatron name: tensor}`` for every name of ``expected``, in the Hugging Face dtype.

    Raises:
        ValueError: a Megatron weight has no rule, a Hugging Face tensor it needs is missing,
            a Hugging Face tensor is left unused, or a shape differs — each listing the names.
    """
    out, used, missing, unruled, wrong = {}, set(), [], [], []
    for name, shape in expected.items():
        rule, groups = _match(arch.rules, name, "megatron")
        if rule is None:
            unruled.append(name)
            continue
        sources = [_fill(p, groups) for p in rule.hf]
        absent = [s for s in sources if s not in hf_state]
        if absent:
            missing += absent
            continue
        used.update(sources)
        tensor = _to_megatron(rule, [hf_state[s] for s in sources], shapes)
        if tuple(tensor.shape) != tuple(shape):
            wrong.append(f"{name} {tuple(tensor.shape)} != {tuple(shape)}")
            continue
        out[name] = tensor.contiguous()
    if unruled:
        raise ValueError(f"{arch.name} has no rule for these Megatron weights: {_listing(unruled)}")
    if missing:
        raise ValueError(f"missing Hugging Face tensors: {_listing(missing)}")
    extra = set(hf_state) - used
    if extra:
        raise ValueError(
            f"Hugging Face tensors with no place in the Megatron model: {_listing(extra)}"
        )
    if wrong:
        raise ValueError(f"shape mismatch after conversion: {_listing(wrong)}")
    return out
