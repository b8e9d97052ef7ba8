"""Llama: published sizes, the model's shape contracts, FLOPs, flavor lookup and parallelize."""

import ast
import copy
import dataclasses
from pathlib import Path

import pytest
import torch

from ember.models import MODELS, build_model_args
from ember.models.llama import FLAVORS, LlamaArgs, Transformer, flops_per_token, num_params, tp_plan
from ember.nn.decoder import apply_rope
from ember.parallel.parallelize import ParallelOptions, parallelize

# Published parameter counts (Meta's model cards; HF num_parameters() of the released checkpoints).
PUBLISHED = {
    ("llama2", "7B"): 6_738_415_616,
    ("llama2", "13B"): 13_015_864_320,
    ("llama2", "70B"): 68_976_648_192,
    ("llama3", "8B"): 8_030_261_248,
    ("llama3", "70B"): 70_553_706_496,
    ("llama3.1", "8B"): 8_030_261_248,
    ("llama3.1", "70B"): 70_553_706_496,
    ("llama3.1", "405B"): 405_853_388_800,
    ("llama3.2", "1B"): 1_235_814_400,
    ("llama3.2", "3B"): 3_212_749_824,
}
# The SwiGLU hidden sizes of the releases (intermediate_size in their HF config.json).
FFN_HIDDEN = {
    ("llama2", "7B"): 11008, ("llama2", "13B"): 13824, ("llama2", "70B"): 28672,
    ("llama3", "8B"): 14336, ("llama3", "70B"): 28672, ("llama3.1", "8B"): 14336, ("llama3.1", "70B"): 28672,
    ("llama3.1", "405B"): 53248, ("llama3.2", "1B"): 8192, ("llama3.2", "3B"): 8192,
}


def _meta_model(args: LlamaArgs) -> Transformer:
    with torch.device("meta"):
        return Transformer(args)


def _debug_model(family="llama3", seed=0, **overrides) -> Transformer:
    args = build_model_args(family, "debug", {"n_layers": 2, **overrides})
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def test_every_family_and_flavor_is_listed():
    assert {f: sorted(v) for f, v in FLAVORS.items()} == {
        "llama2": ["13B", "70B", "7B"],
        "llama3": ["70B", "8B", "debug"],
        "llama3.1": ["405B", "70B", "8B", "debug"],
        "llama3.2": ["1B", "3B", "debug"],
    }
    assert set(MODELS) >= {"gemma2", "gemma3", "glam", "gpt", "llama2", "llama3", "llama3.1", "llama3.2", "llama4",
                           "mistral", "mixtral", "phi3", "qwen2", "qwen3", "qwen3_moe"}


@pytest.mark.parametrize("family, flavor", sorted(PUBLISHED))
def test_parameter_counts_equal_published(family, flavor):
    args = build_model_args(family, flavor)
    assert args.ffn_hidden_dim == FFN_HIDDEN[(family, flavor)]
    assert num_params(_meta_model(args)) == PUBLISHED[(family, flavor)]


def test_debug_flavors_by_hand():
    # embedding + output (once if tied) + per layer (q, o: d*d; k, v: d*d/2; 3 SwiGLU matrices; 2 norms) + norm
    d, hidden, vocab = 256, 704, 8192  # 704 = 64 * ceil(int(8 * 256 / 3) / 64)
    layer = 2 * d * d + 2 * d * (d // 2) + 3 * d * hidden + 2 * d
    for family, tied in (("llama3", False), ("llama3.1", False), ("llama3.2", True)):
        args = build_model_args(family, "debug")
        assert (args.ffn_hidden_dim, args.head_dim, args.kv_heads, args.tie_embeddings) == (hidden, 32, 4, tied)
        expected = vocab * d * (1 if tied else 2) + 4 * layer + d
        assert num_params(_meta_model(args)) == expected == (5_048_576 if tied else 7_145_728)


def test_rope_settings_of_the_releases():
    assert FLAVORS["llama2"]["7B"].rope_theta == 10000.0 and FLAVORS["llama2"]["7B"].rope_scaling_factor is None
    assert FLAVORS["llama3"]["8B"].rope_theta == 500000.0 and FLAVORS["llama3"]["8B"].rope_scaling_factor is None
    a = FLAVORS["llama3.1"]["405B"]
    assert (a.rope_theta, a.rope_scaling_factor, a.rope_low_freq_factor, a.rope_high_freq_factor,
            a.rope_original_max_seq_len, a.max_seq_len) == (500000.0, 8.0, 1.0, 4.0, 8192, 131072)
    assert FLAVORS["llama3.2"]["1B"].rope_scaling_factor == 32.0 and FLAVORS["llama3.2"]["3B"].tie_embeddings


def test_model_files_do_not_import_torch_distributed():
    files = sorted((Path(__file__).parents[2] / "ember" / "models").glob("*/model.py"))
    assert files
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            assert not any(n.startswith("torch.distributed") for n in names), f"{path} imports torch.distributed"


def test_meta_build_then_init_is_finite_deterministic_and_torchtitan_like():
    a, b = _debug_model(seed=0), _debug_model(seed=0)
    tokens = torch.arange(32).view(2, 16)
    with torch.no_grad():
        out = a(tokens)
        assert out.shape == (2, 16, 8192) and out.dtype == torch.float32 and torch.isfinite(out).all()
        assert torch.equal(out, b(tokens))
    assert torch.equal(a.norm.weight, torch.ones(256)) and torch.equal(a.layers["1"].ffn_norm.weight, torch.ones(256))
    assert a.tok_embeddings.weight.std().item() == pytest.approx(1.0, rel=0.02)
    assert a.output.weight.std().item() == pytest.approx(256**-0.5, rel=0.05)  # trunc at 3 std: ~0.986 of std
    # depth-scaled output projections: 0.02 / sqrt(2 (layer + 1))
    assert a.layers["1"].attention.wo.weight.std().item() == pytest.approx(0.01, rel=0.03)
    assert a.layers["1"].attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.03)
    assert a.rope_cos.dtype == torch.float32 and a.rope_cos.shape == (2048, 16)


def test_tied_embeddings_share_one_parameter():
    model = _debug_model("llama3.2")
    assert model.output.weight is model.tok_embeddings.weight
    assert model.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.03)  # also the output matrix
    assert num_params(model, exclude_embedding=True) == num_params(model) - 8192 * 256


def test_rope_rotates_consecutive_pairs():
    x = torch.randn(1, 3, 2, 4)  # (B, T, H, D)
    angle = torch.tensor([[0.0, 0.0], [0.5, 0.25], [1.0, 0.5]])  # (T, D/2)
    out = apply_rope(x, angle.cos(), angle.sin())
    t, h, k = 2, 1, 1  # position 2, head 1, pair 1 = dims (2, 3), angle 0.5
    c, s = torch.cos(torch.tensor(0.5)), torch.sin(torch.tensor(0.5))
    x0, x1 = x[0, t, h, 2], x[0, t, h, 3]
    assert torch.allclose(out[0, t, h, 2 * k: 2 * k + 2], torch.stack((x0 * c - x1 * s, x0 * s + x1 * c)))
    assert torch.equal(out[0, 0], x[0, 0])  # angle 0 leaves position 0 unchanged
    assert torch.allclose(out.norm(dim=-1), x.norm(dim=-1), atol=1e-6)  # rotations keep length


def test_attention_is_causal():
    model = _debug_model()
    tokens = torch.randint(0, 8192, (1, 20), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[0, 12:] = (changed[0, 12:] + 1) % 8192
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert torch.equal(a[:, :12], b[:, :12]) and not torch.allclose(a[:, 12:], b[:, 12:])


def test_too_long_sequence_is_refused():
    model = _debug_model(max_seq_len=16)
    with pytest.raises(ValueError, match="sequence length 17 exceeds max_seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_pipeline_stages_compose_to_the_whole_model():
    model = _debug_model(n_layers=4)
    first, last = copy.deepcopy(model), copy.deepcopy(model)
    for i in ("2", "3"):
        del first.layers[i]
    for i in ("0", "1"):
        del last.layers[i]
    first.norm = first.output = None
    last.tok_embeddings = None
    tokens = torch.randint(0, 8192, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = first(tokens)
        assert hidden.shape == (2, 10, 256)
        assert torch.equal(last(hidden), model(tokens))
    assert sorted(dict(last.named_parameters())) == sorted(
        k for k, _ in model.named_parameters() if not k.startswith(("tok_embeddings", "layers.0.", "layers.1.")))


def test_flops_per_token():
    # 6 N + 12 L H Q T, N = every parameter but the input embedding (PaLM appendix B)
    for family, flavor in (("llama3.1", "8B"), ("llama2", "70B"), ("llama3", "debug")):
        args = build_model_args(family, flavor)
        n = num_params(_meta_model(args), exclude_embedding=True)
        attention = 12 * args.n_layers * args.n_heads * args.head_dim * 8192
        assert flops_per_token(args, 8192) == 6 * n + attention
    assert flops_per_token(FLAVORS["llama3.1"]["8B"], 8192) == 6 * 7_504_924_672 + 12 * 32 * 4096 * 8192
    # tied: the shared matrix is still the output matmul's weight, so it stays in N
    tied = build_model_args("llama3.2", "1B")
    assert flops_per_token(tied, 2048) == 6 * PUBLISHED[("llama3.2", "1B")] + 12 * 16 * 2048 * 2048


def test_build_model_args_overrides_and_errors():
    args = build_model_args("llama3.1", "8B", {"n_layers": 2, "dim": None, "max_seq_len": 4096})
    assert (args.n_layers, args.dim, args.max_seq_len) == (2, 4096, 4096)
    assert FLAVORS["llama3.1"]["8B"].n_layers == 32  # the flavor itself is untouched
    with pytest.raises(ValueError,
                       match=r"^unknown model.flavor '9B' for family 'llama3.1' \(choose from debug, 8B, 70B, 405B\)$"):
        build_model_args("llama3.1", "9B")
    with pytest.raises(ValueError, match=r"^unknown model.family 'llama9' \(did you mean 'llama4'\?\); choose from "
                                         r"llama2, llama3, llama3.1, llama3.2, mixtral, gpt, glam, mistral, phi3, "
                                         r"llama4, gemma3, gemma2, qwen2, qwen3, qwen3_moe[a-z_0-9, ]*$"):
        build_model_args("llama9", "8B")
    with pytest.raises(ValueError, match="model.n_expert is not a hyper-parameter of llama3"):
        build_model_args("llama3", "debug", {"n_expert": 8})
    with pytest.raises(ValueError, match="model.n_heads=6"):
        build_model_args("llama3", "debug", {"n_heads": 6})
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.dim = 8  # flavors are shared: args are immutable, change them with build_model_args


def test_parallelize_compile_keeps_parameter_names():
    model = _debug_model()
    names = [k for k, _ in model.named_parameters()]
    assert parallelize(model, None, tp_plan) is model
    assert parallelize(model, None, tp_plan, ParallelOptions(compile=True)) is model
    assert [k for k, _ in model.named_parameters()] == names
    assert all(block._compiled_call_impl is not None for block in model.layers.values())


def test_blocks_trace_as_one_graph():
    # What apply_compile's fullgraph=True needs, checked with dynamo's eager backend (inductor's
    # code generation takes ~15 s on CPU, too slow for this suite).
    torch._dynamo.reset()
    model = _debug_model()
    block = model.layers["0"]
    x = torch.randn(2, 12, 256)
    cos, sin = model.rope_cos[:12], model.rope_sin[:12]
    compiled = torch.compile(block, fullgraph=True, backend="eager")
    with torch.no_grad():
        assert torch.allclose(compiled(x, cos, sin), block(x, cos, sin), atol=1e-6)
