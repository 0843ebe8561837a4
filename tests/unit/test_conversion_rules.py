"""The Megatron <-> Hugging Face mapping on its own (no processes, no checkpoints)."""

import json
import os

import pytest
import torch

from tst_megatron.conversion import hf, hf_files, mlm, rules
from tst_megatron.models.pattern import gpt_equivalent

transformers = pytest.importorskip("transformers")
pytest.importorskip("megatron.training")

#: A Qwen3-MoE-like model as Megatron-LM flags (vocabulary 100 padded to 128).
FLAGS = [
    "--vocab-size", "100", "--tokenizer-type", "NullTokenizer",
    "--num-layers", "2", "--hidden-size", "24", "--num-attention-heads", "6",
    "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "4",
    "--ffn-hidden-size", "40", "--swiglu", "--disable-bias-linear", "--qk-layernorm",
    "--num-experts", "3", "--moe-ffn-hidden-size", "8",
    "--untie-embeddings-and-output-weights", "--seq-length", "16",
    "--max-position-embeddings", "16", "--position-embedding-type", "rope",
    "--normalization", "RMSNorm",
]  # fmt: skip


def _args(extra=()):
    """Megatron-LM's validated ``args`` namespace for :data:`FLAGS` + ``extra``, as a
    checkpoint of the launcher stores it."""
    return mlm.megatron_lm_namespace(FLAGS + list(extra), padded_vocab_size=128)


def _megatron_state(args, seed=0):
    """A random state dict with the names and shapes of the 1-process local-spec GPTModel."""
    g = torch.Generator().manual_seed(seed)
    h, d, q, kv = (
        args.hidden_size,
        args.kv_channels,
        args.num_attention_heads,
        args.num_query_groups,
    )
    state = {
        "embedding.word_embeddings.weight": torch.randn(128, h, generator=g),
        "decoder.final_layernorm.weight": torch.randn(h, generator=g),
        "output_layer.weight": torch.randn(128, h, generator=g),
    }
    for layer in range(args.num_layers):
        p = f"decoder.layers.{layer}."
        state[p + "input_layernorm.weight"] = torch.randn(h, generator=g)
        state[p + "self_attention.linear_qkv.weight"] = torch.randn(
            (q + 2 * kv) * d, h, generator=g
        )
        state[p + "self_attention.linear_proj.weight"] = torch.randn(h, q * d, generator=g)
        state[p + "self_attention.q_layernorm.weight"] = torch.randn(d, generator=g)
        state[p + "self_attention.k_layernorm.weight"] = torch.randn(d, generator=g)
        state[p + "pre_mlp_layernorm.weight"] = torch.randn(h, generator=g)
        state[p + "mlp.router.weight"] = torch.randn(args.num_experts, h, generator=g)
        for e in range(args.num_experts):
            ep = p + f"mlp.experts.local_experts.{e}."
            state[ep + "linear_fc1.weight"] = torch.randn(16, h, generator=g)
            state[ep + "linear_fc2.weight"] = torch.randn(h, 8, generator=g)
    return state


def test_qkv_and_gate_up_layouts_against_a_plain_reference():
    args = _args()
    state = _megatron_state(args)
    out = rules.megatron_to_hf(state, rules.ARCHITECTURES["qwen3_moe"], hf.shapes_of(args))
    qkv = state["decoder.layers.1.self_attention.linear_qkv.weight"]
    # 6 query heads in 2 groups of 3, head dim 4: per group 3 q heads, then k, then v
    for group in range(2):
        base = group * 5 * 4
        for j in range(3):
            head = group * 3 + j
            assert torch.equal(
                out["model.layers.1.self_attn.q_proj.weight"][head * 4 : (head + 1) * 4],
                qkv[base + j * 4 : base + (j + 1) * 4],
            )
        assert torch.equal(
            out["model.layers.1.self_attn.k_proj.weight"][group * 4 : (group + 1) * 4],
            qkv[base + 12 : base + 16],
        )
        assert torch.equal(
            out["model.layers.1.self_attn.v_proj.weight"][group * 4 : (group + 1) * 4],
            qkv[base + 16 : base + 20],
        )
    fc1 = state["decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight"]
    assert torch.equal(out["model.layers.0.mlp.experts.2.gate_proj.weight"], fc1[:8])
    assert torch.equal(out["model.layers.0.mlp.experts.2.up_proj.weight"], fc1[8:])
    assert out["model.embed_tokens.weight"].shape == (100, 24)
    assert out["lm_head.weight"].shape == (100, 24)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_megatron_hf_megatron_is_exact(model_type):
    args = _args()
    state = _megatron_state(args)
    if model_type == "mixtral":
        state = {
            k: v for k, v in state.items() if "layernorm.weight" not in k or "_attention." not in k
        }
    arch = rules.ARCHITECTURES[model_type]
    shapes = hf.shapes_of(args)
    out = rules.megatron_to_hf(state, arch, shapes)
    back = rules.hf_to_megatron(out, {k: v.shape for k, v in state.items()}, arch, shapes)
    for name, tensor in state.items():
        if "word_embeddings" in name or "output_layer" in name:
            assert torch.equal(back[name][:100], tensor[:100]) and not back[name][100:].any()
        else:
            assert torch.equal(back[name], tensor), name


def test_missing_extra_and_unplaced_tensors_are_listed():
    args = _args()
    arch, shapes = rules.ARCHITECTURES["qwen3_moe"], hf.shapes_of(args)
    state = _megatron_state(args)
    out = rules.megatron_to_hf(state, arch, shapes)
    expected = {k: v.shape for k, v in state.items()}
    broken = dict(out)
    del broken["model.layers.1.mlp.experts.0.up_proj.weight"]
    with pytest.raises(
        ValueError,
        match=r"missing Hugging Face tensors: model\.layers\.1\.mlp\.experts\.0\.up_proj",
    ):
        rules.hf_to_megatron(broken, expected, arch, shapes)
    with pytest.raises(
        ValueError, match="no place in the Megatron model: model.layers.0.mlp.shared_expert.weight"
    ):
        rules.hf_to_megatron(
            dict(out, **{"model.layers.0.mlp.shared_expert.weight": torch.zeros(1)}),
            expected,
            arch,
            shapes,
        )
    with pytest.raises(
        ValueError,
        match="Mixtral has no tensor for these Megatron weights: "
        "decoder.layers.0.self_attention.k_layernorm.weight",
    ):
        rules.megatron_to_hf(state, rules.ARCHITECTURES["mixtral"], shapes)


@pytest.mark.parametrize(
    "extra,message",
    [
        (
            ["--normalization", "LayerNorm"],
            "--normalization LayerNorm: Qwen3-MoE, Mixtral, Qwen3 or Llama use RMSNorm",
        ),
        (
            ["--moe-shared-expert-intermediate-size", "8"],
            "--moe-shared-expert-intermediate-size: Qwen3-MoE has no shared expert",
        ),
        (["--moe-router-score-function", "sigmoid"], "--moe-router-score-function sigmoid"),
        (
            ["--position-embedding-type", "learned_absolute"],
            "--position-embedding-type learned_absolute",
        ),
        (["--rotary-percent", "0.5"], "--rotary-percent 0.5: .* rotate every channel"),
        (
            ["--rotary-seq-len-interpolation-factor", "2"],
            "--rotary-seq-len-interpolation-factor 2: .* without RoPE scaling",
        ),
    ],
)
def test_settings_without_a_target_are_named(extra, message):
    with pytest.raises(ValueError, match=message):
        hf.target_architecture(_args(extra))


def test_targets_follow_the_settings():
    assert hf.target_architecture(_args()).name == "Qwen3-MoE"
    no_qk = _args()
    no_qk.qk_layernorm = False
    assert hf.target_architecture(no_qk).name == "Mixtral"
    no_qk.moe_layer_freq = 2
    with pytest.raises(ValueError, match="--moe-layer-freq 2: every Mixtral layer is MoE"):
        hf.target_architecture(no_qk)
    dense = _args()
    dense.num_experts = None
    assert hf.target_architecture(dense).name == "Qwen3"
    dense.qk_layernorm = False
    assert hf.target_architecture(dense).name == "Llama"


def test_config_round_trip_through_transformers(tmp_path):
    args = _args(
        [
            "--moe-layer-freq",
            "2",
            "--norm-epsilon",
            "1e-6",
            "--rotary-base",
            "1000000",
            "--moe-router-pre-softmax",
        ]
    )
    config = hf.hf_config(args, dtype="bfloat16")
    config.save_pretrained(tmp_path)
    loaded = transformers.AutoConfig.from_pretrained(tmp_path)
    assert loaded.mlp_only_layers == [1] and loaded.norm_topk_prob is False
    assert (loaded.intermediate_size, loaded.moe_intermediate_size, loaded.head_dim) == (40, 8, 4)
    flags, arch, dtype = hf.flags_from_hf(loaded, make_vocab_size_divisible_by=64)
    assert arch.name == "Qwen3-MoE" and dtype == "bfloat16"
    back = mlm.megatron_lm_namespace(
        flags + hf.run_flags_from_hf(loaded), padded_vocab_size=128, vocab_size=100
    )
    names = """num_layers hidden_size ffn_hidden_size num_attention_heads group_query_attention
        num_query_groups kv_channels position_embedding_type normalization swiglu
        untie_embeddings_and_output_weights add_bias_linear qk_layernorm num_experts
        moe_ffn_hidden_size moe_router_topk moe_router_pre_softmax moe_router_score_function
        layernorm_epsilon rotary_base vocab_size padded_vocab_size params_dtype"""
    for name in names.split():
        assert getattr(back, name) == getattr(args, name), name
    assert mlm.layer_freq(back) == mlm.layer_freq(args) == 2
    assert back.layernorm_epsilon == 1e-6 and back.rotary_base == 1000000


def test_unsupported_hf_configs_are_named():
    config = transformers.AutoConfig.for_model("llama", hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        hf.flags_from_hf(config)
    config = transformers.AutoConfig.for_model(
        "llama", rope_scaling={"rope_type": "linear", "factor": 2.0}
    )
    with pytest.raises(ValueError, match="RoPE scaling 'linear'"):
        hf.flags_from_hf(config)
    config = transformers.AutoConfig.for_model(
        "qwen3_moe", num_hidden_layers=4, decoder_sparse_step=2
    )
    with pytest.raises(ValueError, match=r"MoE layers \[1, 3\] are not every n-th layer"):
        hf.flags_from_hf(config)
    config = transformers.AutoConfig.for_model("gpt2")
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        hf.flags_from_hf(config)


def test_hf_dir_is_sharded_above_the_limit_and_never_overwritten(tmp_path):
    args = _args()
    state = rules.megatron_to_hf(
        _megatron_state(args), rules.ARCHITECTURES["qwen3_moe"], hf.shapes_of(args)
    )
    config = hf.hf_config(args, dtype="float32")
    out = tmp_path / "hf"
    hf_files.write_hf_dir(str(out), config, state, max_shard_size="20KB")
    index = json.load(open(out / "model.safetensors.index.json"))
    assert len(set(index["weight_map"].values())) > 1 and set(index["weight_map"]) == set(state)
    read_config, read = hf_files.read_hf_dir(str(out))
    assert set(read) == set(state) and all(torch.equal(read[k], state[k]) for k in state)
    before = sorted(os.listdir(out))
    with pytest.raises(FileExistsError, match=r"exists \(a previous export\); pass --force"):
        hf_files.write_hf_dir(str(out), config, state)
    assert sorted(os.listdir(out)) == before and os.listdir(tmp_path) == ["hf"]


def test_tokenizer_files_load_in_transformers(tmp_path):
    from tst_megatron.data.tokenizer import train_tokenizer

    texts = [f"def f{i}(x):\n    return x * {i}  # héllo wörld" for i in range(300)]
    model = train_tokenizer(texts, str(tmp_path / "tok"), vocab_size=300)
    hf_files.write_tokenizer(str(tmp_path), model)
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=model)
    text = "def f7(x):\n    return x * 7  # héllo"
    assert tok(text, add_special_tokens=False)["input_ids"] == sp.encode(text)
    assert tok.eos_token_id == sp.eos_id() == hf_files.special_ids(model, 300)["eos_token_id"]


def _hybrid_args(pattern):
    """:data:`FLAGS` as a ``HybridModel`` checkpoint's ``args``: the pattern instead of
    ``--num-layers``."""
    args = _args()
    args.hybrid_layer_pattern = pattern
    args.num_layers = len(pattern.split("/")[0].replace("|", ""))  # as Megatron-LM sets it
    return args


@pytest.mark.parametrize(
    "pattern, message",
    [
        ("**EE", r"each an attention layer '\*' followed by its MLP '-' or MoE 'E' layer"),
        ("*EE*", "'\\*EE\\*' does not pair up that way"),
        ("*-*", "does not pair up"),
        ("M*ME", r"M \(Mamba-2\) layers have no place"),
        ("*EG*", r"G \(gated delta net\) layers have no place"),
        ("*E*E/*E", r"multi-token prediction layers \(after '/'\) have no place"),
    ],
)
def test_a_hybrid_pattern_that_is_no_gpt_is_refused_in_one_line(pattern, message):
    with pytest.raises(ValueError, match=message) as info:
        mlm.check_supported(_hybrid_args(pattern))
    assert "\n" not in str(info.value)
    assert str(info.value).startswith(f"--hybrid-layer-pattern {pattern}: ")


def test_a_gpt_shaped_hybrid_is_the_gpt_of_its_pairs():
    # every '*X' pair is one GPT layer; 'E' positions are the MoE layers
    for pattern, layers, freq in [
        ("*E*E", 2, [1, 1]),
        ("*E|*E", 2, [1, 1]),
        ("*E*-*E*-", 4, [1, 0, 1, 0]),
    ]:
        args = _hybrid_args(pattern)
        mlm.check_supported(args)
        gpt = gpt_equivalent(args)
        assert gpt.hybrid_layer_pattern is None and gpt.num_layers == layers
        assert gpt.moe_layer_freq == freq and gpt.num_experts == 3
        assert args.hybrid_layer_pattern == pattern  # the checkpoint's args are left alone
    assert hf.target_architecture(gpt_equivalent(_hybrid_args("*E*-*E*-"))).name == ("Qwen3-MoE")
    with pytest.raises(ValueError, match="every n-th layer"):  # MoE at layers 1 and 2 only
        hf.target_architecture(gpt_equivalent(_hybrid_args("*-*E*E*-")))
    dense = gpt_equivalent(_hybrid_args("*-*-*-"))
    assert dense.num_layers == 3 and dense.num_experts is None
    assert hf.target_architecture(dense).name == "Qwen3"
    # --num-experts given but no E layer (the Slurm template's default): a dense GPT whose
    # TransformerConfig builds (validate_args had filled --moe-ffn-hidden-size in)
    assert dense.moe_ffn_hidden_size is None
    assert mlm.transformer_config(dense).num_moe_experts is None
    plain = _args()
    assert gpt_equivalent(plain) is plain


def test_a_hybrids_tensors_get_the_names_of_its_gpt():
    args = _hybrid_args("*E*E")
    gpt_state = _megatron_state(gpt_equivalent(args))
    # the same tensors as a 4-layer hybrid names them (megatron-core's migration guide)
    hybrid_state = {}
    for name, tensor in gpt_state.items():
        parts = name.split(".")
        if name.startswith("decoder.layers."):
            i, rest = int(parts[2]), ".".join(parts[3:])
            attention = rest.startswith(("input_layernorm", "self_attention"))
            name = f"decoder.layers.{2 * i + (0 if attention else 1)}.{rest}"
        hybrid_state[name.replace("final_layernorm", "final_norm")] = tensor
    assert "decoder.final_norm.weight" in hybrid_state
    renamed = mlm.hybrid_to_gpt_names(hybrid_state, args)
    assert renamed.keys() == gpt_state.keys()
    assert all(renamed[k] is gpt_state[k] for k in gpt_state)
    misplaced = dict(hybrid_state)
    misplaced["decoder.layers.1.self_attention.linear_proj.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match="decoder.layers.1.self_attention.linear_proj.weight"):
        mlm.hybrid_to_gpt_names(misplaced, args)
