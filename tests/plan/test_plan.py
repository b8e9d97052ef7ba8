"""`ember plan`: shard sizes pinned against hand computations at full scale, the planned peak and offload, layout
warnings. The command line is in test_plan_cli.py; the planned bytes against real CPU runs in test_plan_accuracy.py."""

import json
import sys

import pytest
import torch

from ember.cli import main
from ember.parallel.mesh import ParallelMesh
from ember.plan.memory import build_parts, fake_world, named_params, plan_spec, state_bytes, track_step
from ember.plan.planner import make_plan
from ember.plan.stages import cut_stage
from ember.train import run as run_lib

LLAMA_405B_1024 = ["ici_mesh.tensor=8", "ici_mesh.fsdp=1", "dcn_mesh.fsdp=16", "dcn_mesh.data=8", "model.remat=full"]


def _state(recipe: str, overrides: list[str], world: int, rank: int = 0):
    cfg = run_lib.load_config(recipe, overrides, world_size=world)
    spec = plan_spec(cfg, world, "cuda", torch.bfloat16)
    with fake_world(rank, world):
        parts = build_parts(spec, ParallelMesh(spec.shape, "cpu"), [0])
        return state_bytes(named_params(parts))


@pytest.mark.slow
def test_llama_405b_on_1024_ranks_matches_the_hand_computed_shards():
    """tensor=8 within a node, fsdp=16 x data=8 (HSDP) across nodes. Per layer, each rank holds: wq and wo
    16384 x 16384 / (8 x 16), wk and wv 1024 x 16384 / (8 x 16), w1, w2, w3 53248 x 16384 / (8 x 16), two norms
    16384 / 16 (replicated over tensor); embedding and output 128256 x 16384 / (8 x 16) (vocabulary-sharded,
    then FSDP's dim 0), the final norm 16384 / 16."""
    layer = 2 * 16384 * 16384 // 128 + 2 * 1024 * 16384 // 128 + 3 * 53248 * 16384 // 128 + 2 * 16384 // 16
    elements = 126 * layer + 2 * 128256 * 16384 // 128 + 16384 // 16
    tensors = 126 * 9 + 3
    for rank in (0, 1023):  # the first and the last rank: every dimension divides evenly
        state = _state("llama3.1-405b", LLAMA_405B_1024, 1024, rank)
        assert state.param == elements * 4 == 12_683_825_152  # 12,096.2 MiB of fp32 master weights
        assert state.grad == elements * 4
        assert state.optim == 2 * elements * 4 + 4 * tensors  # exp_avg, exp_avg_sq, and a float32 step each
        assert state.even


def test_mixtral_8x22b_with_expert_parallelism_matches_the_hand_computed_shards():
    """expert=8 within a node (one expert per rank), data=8 across nodes. The dense parameters are sharded
    over the expert axis (FSDP's group is fsdp x context x expert), replicated over data (HSDP); each rank's
    expert is whole (nothing else shards it: expert_fsdp_mesh is data only)."""
    dim, hidden, vocab = 6144, 16384, 32768
    dense = 2 * dim * dim // 8 + 2 * 1024 * dim // 8 + 2 * dim // 8 + 8 * dim // 8  # attention, norms, router
    experts = 3 * hidden * dim  # w1, w2, w3 of one expert
    elements = 56 * (dense + experts) + 2 * vocab * dim // 8 + dim // 8
    state = _state("mixtral-8x7b", ["model.flavor=8x22B", "ici_mesh.expert=8", "ici_mesh.fsdp=1", "dcn_mesh.data=8",
                                    "global_batch_size=64", "micro_batch_size=1"], 64)
    assert state.param == elements * 4 == 70_315_035_648
    assert state.optim == 2 * elements * 4 + 4 * (56 * 10 + 3)


def test_stacked_experts_without_expert_parallelism_are_split_over_every_fsdp_rank():
    """Mixtral 8x7B at fsdp=256 with no expert axis (torchprime's layout, mixtral-8x7b-v6e-256): FSDP's dim 0 left the
    8 stacked experts whole on ranks 0-7 and empty on the other 248 (21 GiB of fp32 weights each on those 8, a
    planned peak of 430 GiB); their rows are split instead (ember.parallel.fsdp), as an expert-parallel unit's are."""
    dim, hidden = 4096, 14336
    cfg = run_lib.load_config("mixtral-8x7b-v6e-256", [], world_size=256)
    spec = plan_spec(cfg, 256, "cuda", torch.bfloat16)
    for rank in (0, 255):
        with fake_world(rank, 256):
            parts = build_parts(spec, ParallelMesh(spec.shape, "cpu"), [0])
            shapes = [tuple(p.to_local().shape) for name, p in named_params(parts) if ".experts.w" in name]
        assert len(shapes) == 32 * 3
        assert set(shapes) == {(8, hidden // 256, dim), (8, dim // 256, hidden)}, rank


def test_stacked_experts_whose_rows_do_not_divide_stay_split_by_expert():
    """FSDP2 splits any dim but 0 only evenly: the debug Mixtral's 8 experts of 448 rows at fsdp=3 keep dim 0 (3, 3 and
    2 experts a rank), where their rows raised NotImplementedError at the build."""
    cfg = run_lib.load_config("debug", ["model.family=mixtral", "model.flavor=debug", "ici_mesh.fsdp=3",
                                        "global_batch_size=3", "micro_batch_size=1"], world_size=3)
    spec = plan_spec(cfg, 3, "cuda", torch.bfloat16)
    with fake_world(2, 3):
        parts = build_parts(spec, ParallelMesh(spec.shape, "cpu"), [0])
        shapes = {tuple(p.to_local().shape) for name, p in named_params(parts) if ".experts.w" in name}
    assert shapes == {(2, 448, 256), (2, 256, 448)}


@pytest.mark.slow
def test_every_ranks_uneven_shards_are_read_off_one_build():
    """Where shards are uneven the plan gives every rank its own bytes (up to planner.EXACT_WORLD ranks), computed from
    the role's one build at each rank's mesh index (memory.local_numel): they equal that rank's own build. Mixtral's
    debug experts at fsdp=3 x expert=2 x tensor=2: 8 experts of 448 rows, FSDP over 3 ranks of dim 0 (2, 1 and 1 of the
    4 each expert rank holds), attention and embeddings cut 3 ways with TP's _StridedShard beneath."""
    overrides = ["model.family=mixtral", "model.flavor=debug", "ici_mesh.fsdp=3", "ici_mesh.expert=2",
                 "ici_mesh.tensor=2", "global_batch_size=6", "micro_batch_size=1"]
    spec = plan_spec(run_lib.load_config("debug", overrides, world_size=12), 12, "cuda", torch.bfloat16)
    with fake_world(0, 12):
        first = named_params(build_parts(spec, ParallelMesh(spec.shape, "cpu"), [0]))
    built = [_state("debug", overrides, 12, rank) for rank in range(12)]
    assert [state_bytes(first, on=(spec.shape, rank)) for rank in range(12)] == built
    assert len({state.param for state in built}) > 1 and not any(state.even for state in built)


@pytest.mark.slow
def test_a_smaller_micro_batch_is_planned_with_the_accumulation_it_brings(monkeypatch):
    """At 2 rows a step of 4 runs two micro-batches, the second backward with the first's gradients held, which a step
    of one micro-batch never does. The largest micro-batch that fits was read off the job's own tracked step, without
    them: MaxText's 64B on v5e chips at 2 sequences was told 1 fits, and planned at 1 it did not. Here 4 rows at once
    peak lower than 2 accumulated twice: where 4 do not fit, 2 do not either (the plan of 4 said 2 fit, at 72,109,220
    bytes)."""
    from ember.plan import cost

    base = ["ici_mesh.fsdp=2", "global_batch_size=8", "data.dataset=synthetic", "seq_len=64", "model.remat=full"]

    def plan(micro_batch: int):
        cfg = run_lib.load_config("debug", [*base, f"micro_batch_size={micro_batch}"], world_size=2)
        return make_plan(cfg, 2, device="h100")

    four = plan(4)
    assert (four.ranks[0].peak_bytes, plan(2).ranks[0].peak_bytes) == (74_207_396, 76_845_732)
    monkeypatch.setattr(cost, "usable_bytes", lambda fab: four.ranks[0].peak_bytes - 1)
    replanned = plan(4)
    assert (replanned.fits, replanned.max_micro_batch) == (False, None)


# experts of 2048 rows (the flavor's 448 x 4): they outweigh the rest, as at full scale
MIXTRAL_DEBUG = ["model.flavor=debug", "model.ffn_hidden_dim=2048", "data.dataset=synthetic", "seq_len=64",
                 "micro_batch_size=1", "global_batch_size=4"]


def test_expert_parallelism_without_fsdp_counts_the_experts_as_held_state():
    """Mixtral debug at expert=2, fsdp=1: each rank holds 4 of the 8 experts whole (FSDP leaves them alone, the expert
    axis being their only data axis) and half of each dense parameter (sharded over the expert axis). Per layer:
    wq, wo 256 x 256, wk, wv 128 x 256, two norms of 256 and the router 8 x 256, halved; experts 3 x 4 x 2048 x 256;
    the embedding and output 8192 x 256 and the final norm, halved. torch's FSDPMemTracker counted such experts only at
    their first use in the forward, as activations (16.1 GiB of them for Qwen3-30B-A3B on 8 H100s instead of 2.6),
    and DTensor's sharding propagation allocated every rank's experts at each new op (a negative peak for Mixtral
    8x7B on 8 H100s)."""
    dense = (2 * 256 * 256 + 2 * 128 * 256 + 2 * 256 + 8 * 256) // 2
    elements = 4 * (dense + 3 * 4 * 2048 * 256) + (2 * 8192 * 256 + 256) // 2
    cfg = run_lib.load_config("mixtral-8x7b", [*MIXTRAL_DEBUG, "ici_mesh.expert=2", "ici_mesh.fsdp=1"], world_size=2)
    plan = make_plan(cfg, 2, device="cpu")
    assert plan.mesh == "expert=2" and not plan.warnings
    for rank in plan.ranks:
        assert rank.param_bytes == rank.grad_bytes == elements * 4 == 110_645_760
        assert rank.optim_bytes == 2 * elements * 4 + 4 * (4 * 10 + 3)  # a float32 step per tensor
        assert rank.peak_bytes >= rank.param_bytes + rank.grad_bytes + rank.optim_bytes + rank.activation_bytes
    # fsdp=2 holds the same bytes (FSDP splits the experts 4 and 4) and the same rows per rank: the same activations;
    # a step tracked before the DTensor caches are filled peaks as one tracked after (it peaked 17 MB higher)
    for layout, tracks in ((["ici_mesh.fsdp=2"], 1), (["ici_mesh.expert=2", "ici_mesh.fsdp=1"], 2)):
        cfg = run_lib.load_config("mixtral-8x7b", [*MIXTRAL_DEBUG, *layout], world_size=2)
        spec = plan_spec(cfg, 2, "cpu", torch.float32)
        with fake_world(0, 2):
            mesh = ParallelMesh(spec.shape, "cpu")
            steps = [track_step(spec, mesh, cut_stage(spec, mesh, "whole", 4), "whole", 1) for _ in range(tracks)]
        assert steps == steps[:1] * tracks
        assert steps[0].activations == plan.ranks[0].activation_bytes
        # held before the forward: parameters, optimizer state and the rotary tables (2 x 2048 x 16 fp32)
        assert steps[0].static == elements * 4 * 3 + 4 * 43 + 2 * 2048 * 16 * 4


@pytest.mark.parametrize("layout", [["ici_mesh.fsdp=4"], ["ici_mesh.fsdp=2", "ici_mesh.tensor=2"]])
def test_planned_peak_is_the_tracked_step_of_the_whole_depth(layout):
    """The plan tracks a few layers and extends the line they give to the model's depth; that must equal
    tracking every layer. A line through one and two layers counted, per layer, the next block's weights FSDP
    gathers ahead (193 GiB planned for Llama 3.1 70B at fsdp=256 and 8K tokens instead of 17)."""
    # remat=full and short sequences: the gathered weights, not the activations, make the peak
    overrides = ["model.n_layers=8", "model.vocab_size=512", "model.remat=full", "data.dataset=synthetic",
                 "seq_len=32", "micro_batch_size=1", "global_batch_size=4", *layout]
    cfg = run_lib.load_config("debug", overrides, world_size=4)
    plan = make_plan(cfg, 4, device="cpu")
    spec = plan_spec(cfg, 4, "cpu", torch.float32)
    with fake_world(0, 4):
        mesh = ParallelMesh(spec.shape, "cpu")
        whole = track_step(spec, mesh, cut_stage(spec, mesh, "whole", 8), "whole", 1)
    assert plan.ranks[0].peak_bytes == pytest.approx(whole.peak, rel=0.01)


@pytest.mark.slow
def test_a_peak_that_changes_region_with_depth_is_planned_region_by_region():
    """At 3 and 4 layers this step peaks at the backward's end (a 65,536-word embedding's gradient, with the logits
    the trainer holds through the backward), at 16 in the backward's top, on the activations: one line through the
    few layers' peaks planned 5% under the step tracked at 16 layers (Llama 3.1 405B: 8 sequences of 8192 tokens
    per H100 instead of 2); a line per region of the step (trackers.REGIONS) gives it."""
    from ember.plan.stages import model_stage
    from ember.plan.trackers import REGIONS

    overrides = ["model.n_layers=16", "model.vocab_size=65536", "model.remat=none", "data.dataset=synthetic",
                 "seq_len=192", "micro_batch_size=1", "global_batch_size=8", "ici_mesh.fsdp=2", "ici_mesh.tensor=2"]
    cfg = run_lib.load_config("debug", overrides, world_size=4)
    spec = plan_spec(cfg, 4, "cpu", torch.float32)
    with fake_world(0, 4):
        mesh = ParallelMesh(spec.shape, "cpu")
        model = model_stage(spec, mesh, "whole", 1, both_batches=False, fewest_layers=16)
        whole = track_step(spec, mesh, cut_stage(spec, mesh, "whole", 16), "whole", 1)
    few = model.runs[(4, 1)]
    assert few.peak == few.regions[REGIONS.index("backward bottom")]
    assert whole.peak == whole.regions[REGIONS.index("backward top")]
    line = few.peak + 12 * (few.peak - model.runs[(3, 1)].peak)
    assert line < 0.96 * whole.peak
    assert model.at(16, 1).peak == pytest.approx(whole.peak, rel=1e-3)


def test_offload_is_planned_as_full_remat_without_the_block_inputs_and_says_so():
    """Each block's input: 2 rows x 64 tokens x width 256 in fp32 = 131,072 bytes, 4 layers. They leave the
    activations; at the peak they would have been in, here at the backward's end (every gradient, and the logits
    the trainer holds through the backward), no block input is left: the peak stays (see the next test)."""
    base = ["data.dataset=synthetic", "seq_len=64", "micro_batch_size=2", "global_batch_size=4", "ici_mesh.fsdp=2"]
    plans = {remat: make_plan(run_lib.load_config("debug", [*base, f"model.remat={remat}"], world_size=2), 2,
                              device="cpu") for remat in ("offload", "full")}
    inputs = 4 * 2 * 64 * 256 * 4
    full, offload = plans["full"].ranks[0], plans["offload"].ranks[0]
    assert offload.peak_bytes == full.peak_bytes
    assert full.activation_bytes - offload.activation_bytes == pytest.approx(inputs, rel=0.02)
    assert (offload.param_bytes, offload.optim_bytes) == (full.param_bytes, full.optim_bytes)
    assert plans["offload"].step.compute_s == plans["full"].step.compute_s  # it recomputes every block as full does
    assert any(w.startswith("remat=offload: planned as remat=full with each block's input in host memory")
               for w in plans["offload"].warnings)
    assert not any("remat=offload" in w for w in plans["full"].warnings)


def test_offload_takes_the_block_inputs_off_the_regions_that_hold_them():
    """Full remat's activations grow by one block input per layer (100 bytes here): offload takes k of them off
    the forwards' peak and the backward's top and middle (which peak holding them all), not off the backward's
    bottom or the optimizer (which hold at most one); the peak is the largest region's after that."""
    from ember.plan.memory import Tracked
    from ember.plan.stages import StageModel, offloaded

    def run(k: int, forward: int, bottom: int) -> Tracked:
        regions = (forward, forward - 10, forward - 20, bottom, 500)
        return Tracked(max(regions), 1000, 50 + 100 * k, regions)

    model = offloaded(StageModel({(3, 2): run(3, 2000, 1900), (4, 2): run(4, 2400, 2000)}, {}))
    assert model.runs[(3, 2)] == Tracked(1900, 1000, 50, (1700, 1690, 1680, 1900, 500))
    assert model.runs[(4, 2)] == Tracked(2000, 1000, 50, (2000, 1990, 1980, 2000, 500))
    # past the tracked counts each region goes on along its own line, and the largest is the peak
    assert model.at(8, 2) == Tracked(3200, 1000, 50, (3200, 3190, 3180, 2400, 500))


@pytest.mark.slow
def test_plan_405b_at_1024_ranks_has_every_rank(tmp_path):
    # How long it takes is measured by benchmarks/plan_speed.py, not asserted here: this machine is shared.
    cfg = run_lib.load_config("llama3.1-405b", LLAMA_405B_1024, world_size=1024)
    plan = make_plan(cfg, 1024, device="h100")
    doc = plan.to_json()
    assert list(doc) == ["world_size", "device", "fits", "step_time_s", "mfu", "precision", "peak_flops", "ranks"]
    assert doc["precision"] == "bf16" and doc["peak_flops"] == pytest.approx(989.4e12, rel=1e-3)
    assert doc["world_size"] == 1024 and doc["device"] == "h100" and len(doc["ranks"]) == 1024
    assert list(doc["ranks"][5]) == ["rank", "coordinate", "param_bytes", "grad_bytes", "optim_bytes",
                                     "activation_bytes", "peak_bytes"]
    assert doc["ranks"][5]["coordinate"] == {"data": 0, "fsdp": 0, "tensor": 5}
    assert doc["ranks"][1023]["coordinate"] == {"data": 7, "fsdp": 15, "tensor": 7}
    assert all(r["param_bytes"] == 12_683_825_152 for r in doc["ranks"])
    assert all(r["peak_bytes"] > r["param_bytes"] + r["optim_bytes"] + r["activation_bytes"] for r in doc["ranks"])
    # The step is bound by the traffic FSDP overlaps with compute, plus what cannot overlap; MFU is the model's
    # FLOPs over that step at the H100's dense bf16 peak (989.4 TFLOP/s) on every rank.
    step = plan.step
    assert step.overlapped_s > step.compute_s
    assert doc["step_time_s"] == pytest.approx(step.overlapped_s + step.exposed_s, rel=1e-12)
    assert doc["mfu"] == pytest.approx(step.flops / (doc["step_time_s"] * 1024 * 989.4e12), rel=1e-12)
    # the FLOPs are ember's own formula over the global batch
    assert plan.step.flops == pytest.approx(plan_flops(cfg))
    # 2 sequences of 8192 per rank fit, 4 do not: planned 65.63, 65.88, 72.58 and 96.0 GiB for 1, 2, 4 and 8, the
    # step tracked at all 126 layers 65.63, 65.88, 73.98 and 88.1 GiB. One line through the peaks of a few layers
    # (at the backward's end, on the embedding's and output's gradients) let 8 fit (67.4 GiB)
    assert doc["fits"] and plan.max_micro_batch == 2
    axes = {t.axes[0]: t for t in plan.traffic}
    assert not axes["tensor"].crosses_nodes and axes["fsdp"].crosses_nodes and axes["data"].crosses_nodes


def plan_flops(cfg) -> float:
    from ember.models import MODELS

    args = run_lib.model_choice(cfg).args
    return MODELS[cfg.model.family].flops_per_token(args, cfg.seq_len) * cfg.global_batch_size * cfg.seq_len


@pytest.mark.slow
def test_layout_warnings():
    # tensor=2 on nodes of one device spans two; a 4-stage pipeline fed one micro-batch of 4 sequences idles 43%.
    # (--search's candidates: test_search_json_holds_the_candidates_the_table_lists.)
    cfg = run_lib.load_config("debug", ["ici_mesh.tensor=2", "ici_mesh.fsdp=1", "ici_mesh.pipeline=4",
                                    "micro_batch_size=4", "global_batch_size=8"], world_size=8)
    plan = make_plan(cfg, 8, nodes=8, device="h100")
    text = " ".join(plan.warnings)
    assert "tensor axis (2 ranks) crosses nodes" in text
    assert "pipeline bubble 43%" in text
    # stages differ: the first holds the embedding, the last the output; each keeps its own in-flight count
    first, last = plan.ranks[0], plan.ranks[-1]
    assert first.coordinate["pipeline"] == 0 and last.coordinate["pipeline"] == 3
    assert first.activation_bytes > last.activation_bytes  # 1F1B: 4 micro-batches in flight vs 1


@pytest.mark.slow
def test_fsdp_beyond_the_shard_granularity_is_warned():
    cfg = run_lib.load_config("debug", ["ici_mesh.fsdp=512", "global_batch_size=512", "micro_batch_size=1"],
                              world_size=512)
    plan = make_plan(cfg, 512, device="h100")
    # wk, wv: 4 K/V heads of 32; one line says it, with the bytes at stake and what evens them
    uneven = [w for w in plan.warnings if w.startswith("uneven shards")]
    assert uneven == [uneven[0]] and uneven[0].startswith("uneven shards: 512 FSDP ranks for parameters of 128 rows")
    assert uneven[0].endswith("fewer fsdp, more data ranks (HSDP) even them") and len(uneven[0]) < 200


@pytest.mark.slow
def test_llama4_maverick_with_expert_parallelism_matches_the_hand_computed_shards():
    """expert=64 (8 within a node x 8 across nodes: 2 of the 128 experts per rank), data=8 across nodes on 512 ranks.
    Dense parameters (attention, norms, router, the shared expert, the dense layers' SwiGLU) are sharded over the
    expert axis, the routed experts stay whole. Every other layer has experts, starting at layer 1."""
    dim, kv, hidden, dense_hidden, vocab, ep = 5120, 1024, 8192, 16384, 202048, 64
    attention_and_norms = (2 * dim * dim + 2 * kv * dim + 2 * dim) // ep
    dense_layer = attention_and_norms + 3 * dense_hidden * dim // ep
    moe_layer = attention_and_norms + (128 * dim + 3 * hidden * dim) // ep + 2 * 3 * hidden * dim
    elements = 24 * dense_layer + 24 * moe_layer + (2 * vocab * dim + dim) // ep
    state = _state("llama4-maverick", ["ici_mesh.expert=8", "dcn_mesh.expert=8", "ici_mesh.fsdp=1", "dcn_mesh.data=8",
                                       "global_batch_size=512", "micro_batch_size=1"], 512)
    assert state.param == elements * 4 == 25_044_490_560
    assert state.optim == 2 * elements * 4 + 4 * (24 * 9 + 24 * 13 + 3)


def test_the_tracked_cut_repeats_the_model_past_its_first_layers():
    """The plan's line through its tracked cuts adds whole periods of the repeating layers: Maverick's dense/MoE pairs,
    and DeepSeek-V3's MoE layers after its three dense ones (a line from a dense-only cut to one with a first MoE layer
    counted that layer's gathered experts once per layer: 600 GiB planned for 671B on 2,048 H100s)."""
    from ember.plan.memory import layer_period, layer_prefix

    for recipe, period, prefix in (("llama4-maverick", 2, 0), ("deepseek-v3-671b", 1, 3), ("qwen3-30b-a3b", 1, 0)):
        spec = plan_spec(run_lib.load_config(recipe, [], world_size=8), 8, "cuda", torch.bfloat16)
        assert (layer_period(spec), layer_prefix(spec)) == (period, prefix), recipe


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_plan_says_the_precision_and_peak_it_prices_the_step_at(precision, capsys):
    # A CPU plan's step time depends on it (a bf16 CPU peak is several times the fp32 one), so it is on screen
    cfg = run_lib.load_config("debug", ["model.n_layers=1", f"precision={precision}"])
    plan = make_plan(cfg, 1, device="h100")
    assert plan.precision == precision
    # fp32 as the trainer runs it: TF32 stays off, so the H100's plain fp32 rate, not its TF32 one
    assert plan.peak_flops == pytest.approx(989.4e12 if precision == "bf16" else 66.9e12, rel=1e-3)
    assert plan.step.mfu == pytest.approx(plan.step.flops / plan.step.step_s / plan.peak_flops, rel=1e-6)
    main(["plan", "debug", "model.n_layers=1", f"precision={precision}", "--world", "1", "--device", "h100"])
    title = capsys.readouterr().out.splitlines()[0]
    assert f"{precision} matmuls at {'989.4' if precision == 'bf16' else '66.9'} TFLOP/s peak" in title


@pytest.mark.parametrize("device, target, expected", [("xla", "cpu", torch.float32), ("xla", "h100", torch.float32),
                                                     ("tpu", "tpu-v6e", torch.bfloat16),
                                                     ("xla", "tpu-v5e", torch.bfloat16)])
def test_the_xla_paths_precision_is_planned_as_its_trainer_runs_it(device, target, expected):
    # precision=auto on the XLA path: bf16 on a TPU, fp32 elsewhere (ember.xla.rules), not the torch path's choice
    from ember.plan.planner import compute_dtype

    assert compute_dtype(run_lib.load_config("debug", [f"device={device}"], world_size=1), target) == expected


def test_a_cpu_plan_of_the_xla_path_prices_the_step_at_xla_cpus_own_matmul_rate(tmp_path, monkeypatch):
    from ember.hardware import cpu_rates
    from ember.xla import cpu_rates as xla_rates

    monkeypatch.setenv("EMBER_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_rates, "_IN_PROCESS", {})
    monkeypatch.setattr(cpu_rates, "measure_cpu_matmul_flops", lambda dtype=None: 4e11)
    monkeypatch.setattr(xla_rates, "measure_xla_matmul_flops", lambda dtype: 1e11)
    overrides = ["model.n_layers=1", "precision=fp32", "global_batch_size=8", "micro_batch_size=8"]
    torch_plan = make_plan(run_lib.load_config("debug", overrides), 1, device="cpu")
    xla_plan = make_plan(run_lib.load_config("debug", ["device=xla", *overrides], world_size=1), 1, device="cpu")
    assert (torch_plan.peak_flops, xla_plan.peak_flops) == (4e11, 1e11)
    assert xla_plan.step.step_s == pytest.approx(4 * torch_plan.step.step_s, rel=1e-9)  # one device: no traffic
    assert any("xla:cpu jaxlib" in key for key in json.loads((tmp_path / "hardware" / "cpu-rates.json").read_text()))
    assert "torchax" not in sys.modules  # a plan never renames torch's privateuse1 backend under the torch tests
