"""GPU recipes for ``benchmarks/tst_vs_baseline.py --preset NAME --device cuda``.

The paper's smallest row (``docs/design.md``; Peng et al., arXiv 2605.06546, table 1): a
SmolLM2-135M-shaped dense GPT with untied embeddings, AdamW (0.9, 0.95), LR 2e-3, WSD with
2000 warmup steps and decay over the last 10 %, ~2M tokens per step (1024 x 2048), 20k steps,
S = 6, r = 0.3; final loss baseline 3.212 vs TST 3.142 (on their data and tokenizer).

- ``smollm2-135m``: that row, for 8 nodes x 8 H100 (``slurm/tst_vs_baseline_gpu.sbatch``).
- ``smollm2-135m-small``: the same model on one H100 in under an hour for both arms:
  64 x 2048 tokens per step, 2000 steps, 200 warmup steps, same S, r and LR.

:func:`estimate` gives the expected GPU-hours from FLOPs (see its docstring); the numbers in
``docs/gpu_recipe.md`` are printed by ``python benchmarks/recipes.py``.
"""

from __future__ import annotations

import dataclasses
import sys

H100_BF16_DENSE_FLOPS = 989e12
"""H100 SXM peak dense bf16 tensor-core throughput, FLOP/s (NVIDIA's datasheet, no sparsity)."""
ASSUMED_MFU = 0.30
"""Model-FLOPs utilisation assumed for the estimate: a 135M model with T = 2048 on the
Transformer Engine spec is small per GPU; 30 % is a typical, not a measured, figure here."""


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One GPU configuration: the model shape, the batch, the schedule and the launch size."""

    name: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    """Padded vocabulary (SmolLM2's tokenizer: 49152 ids)."""
    seq_length: int
    """T, tokens per sample in phase 2 (positions per sample in both phases)."""
    micro_batch_size: int
    global_batch_size: int
    """Samples per optimizer step; tokens per step = global_batch_size x seq_length."""
    train_iters: int
    lr_warmup_iters: int
    lr: float
    bag_size: int
    phase1_fraction: float
    nodes: int
    gpus_per_node: int
    eval_interval: int
    eval_iters: int
    local_spec: bool = False
    """megatron-core's local spec (``step_cost.LOCAL_CUDA_FLAGS``) instead of Transformer
    Engine's: for a GPU without TE, such as the lent H200."""
    device: str = "cuda"
    """``cuda`` (bf16), or ``cpu`` for a :meth:`rehearsal` (float32, the launcher's CPU flags)."""

    def rehearsal(self) -> "Recipe":
        """This recipe's command path at a tiny size on a CPU (float32, 2 processes): the same
        flags but 2 layers of h = 64, T = 128, 4 samples per step, 24 steps with evaluations
        every 6, so that ``scripts/gpu_study.sh`` can be rehearsed without a GPU in minutes."""
        return dataclasses.replace(
            self,
            name=f"{self.name}-rehearsal",
            num_layers=2,
            hidden_size=64,
            ffn_hidden_size=176,
            num_attention_heads=4,
            num_query_groups=2,
            seq_length=128,
            micro_batch_size=2,
            global_batch_size=4,
            train_iters=24,
            lr_warmup_iters=2,
            nodes=1,
            gpus_per_node=2,
            eval_interval=6,
            eval_iters=2,
            device="cpu",
        )

    def flags(
        self,
        *,
        data_path: str,
        tokenizer_model: str,
        tokenizer_type: str,
        train_iters=None,
        data_cache_path: str,
    ) -> list[str]:
        """The launcher flags every arm shares (the benchmark adds ``--lr``, ``--min-lr`` and
        the ``--tst-*`` flags per arm, and ``--tensorboard-dir``)."""
        iters = train_iters or self.train_iters
        if self.device == "cpu":  # the launcher adds a CPU run's own flags (local spec, gloo)
            impl = []
        elif self.local_spec:
            from step_cost import LOCAL_CUDA_FLAGS

            impl = list(LOCAL_CUDA_FLAGS)
        else:
            impl = ["--transformer-impl", "transformer_engine"]
        return [
            "--device",
            self.device,
            *(["--bf16"] if self.device == "cuda" else []),
            *impl,
            "--num-layers",
            str(self.num_layers),
            "--hidden-size",
            str(self.hidden_size),
            "--ffn-hidden-size",
            str(self.ffn_hidden_size),
            "--num-attention-heads",
            str(self.num_attention_heads),
            "--group-query-attention",
            "--num-query-groups",
            str(self.num_query_groups),
            "--seq-length",
            str(self.seq_length),
            "--max-position-embeddings",
            str(self.seq_length),
            "--position-embedding-type",
            "rope",
            "--rotary-base",
            "10000",
            "--normalization",
            "RMSNorm",
            "--norm-epsilon",
            "1e-5",
            "--swiglu",
            "--disable-bias-linear",
            "--untie-embeddings-and-output-weights",
            "--init-method-std",
            "0.02",
            "--vocab-size",
            str(self.vocab_size),
            "--hidden-dropout",
            "0",
            "--attention-dropout",
            "0",
            "--micro-batch-size",
            str(self.micro_batch_size),
            "--global-batch-size",
            str(self.global_batch_size),
            "--train-iters",
            str(iters),
            "--lr-decay-style",
            "WSD",
            "--lr-warmup-iters",
            str(self.lr_warmup_iters),
            "--lr-wsd-decay-iters",
            str(max(1, iters // 10)),
            "--weight-decay",
            "0.1",
            "--clip-grad",
            "1.0",
            "--adam-beta1",
            "0.9",
            "--adam-beta2",
            "0.95",
            "--use-distributed-optimizer",
            "--seed",
            "1234",
            "--data-path",
            data_path,
            "--split",
            "99,1,0",
            "--data-cache-path",
            data_cache_path,
            "--tokenizer-type",
            tokenizer_type,
            "--tokenizer-model",
            tokenizer_model,
            "--eval-interval",
            str(self.eval_interval),
            "--eval-iters",
            str(self.eval_iters),
            "--log-interval",
            "10",
        ]

    def parameters(self) -> dict:
        """Parameter counts (no biases; norms included): ``{"total", "non_embedding",
        "flop_params"}``; ``flop_params`` counts the output layer but not the input
        embedding (a lookup, no matmul)."""
        h, f, heads, groups = (
            self.hidden_size,
            self.ffn_hidden_size,
            self.num_attention_heads,
            self.num_query_groups,
        )
        head_dim = h // heads
        attention = h * h + 2 * h * groups * head_dim + h * h  # q, k, v, o
        mlp = 3 * h * f  # SwiGLU: gate, up, down
        layer = attention + mlp + 2 * h  # two RMSNorms
        body = self.num_layers * layer + h  # final norm
        embedding = self.vocab_size * h
        return {
            "total": body + 2 * embedding,
            "non_embedding": body,
            "flop_params": body + embedding,
        }


def estimate(recipe: Recipe, *, mfu: float = ASSUMED_MFU, arms: int = 2) -> dict:
    """Expected compute of ``arms`` runs of ``recipe`` (TST and the baseline cost the same).

    FLOPs per token = ``6 N + 6 L T h`` (Kaplan et al. 2020, "Scaling laws", table 1: 6N for
    forward + backward of the weight matmuls, ``N`` = ``flop_params``; plus causal
    attention's ``QK^T`` and ``AV``, ``2 x 2 L T h`` forward halved by the causal mask, x3
    for backward). GPU-seconds = FLOPs / (``mfu`` x H100 peak dense bf16).

    Returns ``{"tokens_per_step", "tokens", "flops_per_token", "flops", "gpu_hours",
    "wall_hours"}`` (``gpu_hours`` for all arms, ``wall_hours`` on ``nodes x gpus_per_node``).
    """
    n = recipe.parameters()["flop_params"]
    tokens_per_step = recipe.global_batch_size * recipe.seq_length
    tokens = tokens_per_step * recipe.train_iters
    per_token = 6 * n + 6 * recipe.num_layers * recipe.seq_length * recipe.hidden_size
    flops = per_token * tokens * arms
    gpu_hours = flops / (mfu * H100_BF16_DENSE_FLOPS) / 3600
    return {
        "tokens_per_step": tokens_per_step,
        "tokens": tokens,
        "flops_per_token": per_token,
        "flops": flops,
        "gpu_hours": gpu_hours,
        "wall_hours": gpu_hours / (recipe.nodes * recipe.gpus_per_node),
    }


_SMOLLM2_135M = dict(
    num_layers=30,
    hidden_size=576,
    ffn_hidden_size=1536,
    num_attention_heads=9,
    num_query_groups=3,
    vocab_size=49152,
    seq_length=2048,
    lr=2e-3,
    bag_size=6,
    phase1_fraction=0.3,
)

RECIPES = {
    "smollm2-135m": Recipe(
        name="smollm2-135m",
        micro_batch_size=16,
        global_batch_size=1024,  # 2,097,152 tokens per step
        train_iters=20000,
        lr_warmup_iters=2000,
        nodes=8,
        gpus_per_node=8,
        eval_interval=1000,
        eval_iters=10,
        **_SMOLLM2_135M,
    ),
    "smollm2-135m-small": Recipe(
        name="smollm2-135m-small",
        micro_batch_size=16,
        global_batch_size=64,  # 131,072 tokens per step
        train_iters=2000,
        lr_warmup_iters=200,
        nodes=1,
        gpus_per_node=1,
        eval_interval=200,
        eval_iters=10,
        **_SMOLLM2_135M,
    ),
}
"""The recipes by name (``--preset``)."""

#: The GPU study of one lent H200 slot (issue 55): a ~30M-parameter dense GPT (8 layers,
#: h 512, SwiGLU 1408, 8 heads in 4 groups; the carried 32,000-piece tokenizer,
#: ``benchmarks/data/code32k.model``), T 1024, 64 x 1024 = 65,536 tokens per step, 1,500
#: steps: 98M tokens per arm read by the baseline (TST reads 3.6x that in phase 1 at S = 4),
#: about 4 minutes per arm by the H200's measured rate. The paper's dense setting (LR 2e-3 of
#: its 270M row, r = 0.3) with S = 4, the smaller end of its robust range [4, 8]: the CPU
#: horizons favoured small S at short runs. Local spec (no TE on that machine).
RECIPES["h200-study-dense"] = Recipe(
    name="h200-study-dense",
    num_layers=8,
    hidden_size=512,
    ffn_hidden_size=1408,
    num_attention_heads=8,
    num_query_groups=4,
    vocab_size=32000,
    seq_length=1024,
    micro_batch_size=16,
    global_batch_size=64,
    train_iters=1500,
    lr_warmup_iters=100,
    lr=2e-3,
    bag_size=4,
    phase1_fraction=0.3,
    nodes=1,
    gpus_per_node=1,
    eval_interval=150,
    eval_iters=20,
    local_spec=True,
)


def recipe(name: str) -> Recipe:
    """``RECIPES[name]``; ``<name>-rehearsal``: that recipe's :meth:`Recipe.rehearsal`.

    Raises:
        KeyError: no such recipe.
    """
    base = name.removesuffix("-rehearsal")
    return RECIPES[base].rehearsal() if base != name else RECIPES[name]


def main() -> int:
    """Print each recipe's size and expected GPU-hours (the table in docs/gpu_recipe.md)."""
    print(
        f"| recipe | parameters (total / non-embedding) | tokens per step | steps | tokens per arm "
        f"| GPU-hours, 2 arms, at {ASSUMED_MFU:.0%} MFU | wall-clock, 2 arms |"
    )
    print("|---|---|---|---|---|---|---|")
    for recipe in RECIPES.values():
        p, e = recipe.parameters(), estimate(recipe)
        print(
            f"| {recipe.name} | {p['total'] / 1e6:.1f}M / {p['non_embedding'] / 1e6:.1f}M "
            f"| {e['tokens_per_step']:,} | {recipe.train_iters:,} | {e['tokens'] / 1e9:.2f}B "
            f"| {e['gpu_hours']:.1f} | {e['wall_hours']:.2f} h on {recipe.nodes} x "
            f"{recipe.gpus_per_node} H100 |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
