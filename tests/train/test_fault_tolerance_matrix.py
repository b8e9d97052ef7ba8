"""Replica groups across the matrix they join: LoRA on a trained base, and a mixture of experts with expert
parallelism inside each group. Each: two groups (`ember launch local --replica-groups 2`) against one job of the
same ranks with the groups as HSDP's replicate axis (ici_mesh.data=2). LoRA: the same gradient norms and final
weights, bit for bit (an average of two is one sum in either order). MoE: the dense weights' gradients are summed
in another order (one four-way average in HSDP, two two-way ones over groups), so trains_like's tolerances; the
two groups equal each other bit for bit."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_trains_like, job_env, read_records, run_ember, tiny_model

pytestmark = pytest.mark.slow

LR = 1e-2
BASE = ["seq_len=32", "global_batch_size=8", "metrics.console=false", "metrics.tensorboard=false", "eval_batches=1",
        "max_steps=4", "logging_steps=1", "precision=fp32", "schedule.warmup_steps=0"]
MOE = ["model.family=mixtral", "model.flavor=debug", "data.dataset=synthetic", *tiny_model(2),
       "model.vocab_size=512", "model.ffn_hidden_dim=96", "model.n_experts=4", "model.top_k=2",
       "model.aux_loss_coef=0", "model.z_loss_coef=0", f"optim.lr={LR}"]


def _logged(run) -> dict[int, tuple[float, float]]:
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in read_records(run) if "loss" in r}


@pytest.mark.parametrize("case", ["lora", "moe expert=2"])
def test_two_groups_train_like_hsdp(tmp_path, case):
    from ember.model_io.load import load_model

    if case == "lora":
        run_ember("train", "debug", *tiny_model(), *BASE, "micro_batch_size=4", f"output_dir={tmp_path / 'base'}",
                  env=job_env(), expect=0)
        job = ["debug", *tiny_model(), *BASE, "micro_batch_size=4", "lora.rank=4", "lora.alpha=8",
               f"model.init_from={tmp_path / 'base'}"]
        nproc, inside = 1, []
    else:
        job, nproc, inside = ["debug", *MOE, *BASE, "micro_batch_size=2"], 2, ["ici_mesh.fsdp=1", "ici_mesh.expert=2"]
    run_ember("train", "--nproc-per-node", str(2 * nproc), *job, "ici_mesh.data=2", *inside,
              f"output_dir={tmp_path / 'hsdp'}", env=job_env(), expect=0)
    run_ember("launch", "local", "--replica-groups", "2", "--nproc-per-node", str(nproc), *job, *inside,
              f"output_dir={tmp_path / 'groups'}", env=job_env(), expect=0)
    runs = [tmp_path / "hsdp", tmp_path / "groups", tmp_path / "groups" / "replica-group-1"]
    logged = [_logged(run) for run in runs]
    weights = [load_model(run).state_dict() for run in runs]
    # the groups hold one model: equal to each other, bit for bit
    assert logged[1] == logged[2] and logged[1].keys() == set(range(1, 5))
    assert weights[1].keys() == weights[2].keys() == weights[0].keys()
    assert all(torch.equal(weights[1][k], weights[2][k]) for k in weights[0]), case
    if case == "lora":  # a two-way average either way: bit for bit with HSDP (the loss within an ulp)
        for step, (loss, norm) in logged[0].items():
            assert logged[1][step][1] == norm, (case, step)
            assert logged[1][step][0] == pytest.approx(loss, rel=2e-7)
        assert all(torch.equal(weights[1][k], weights[0][k]) for k in weights[0]), case
    else:  # the dense weights' gradients: a four-way sum in HSDP, two two-way averages over the groups
        as_lists = [{"loss": [v[0] for v in run.values()], "grad_norm": [v[1] for v in run.values()]}
                    for run in logged]
        assert_trains_like(as_lists[1], as_lists[0], LR, case)
    if case == "lora":  # the adapters trained (B starts at zero), the base did not
        base = load_model(tmp_path / "base").state_dict()
        assert all(torch.equal(weights[0][k], base[k]) for k in base)
        trained = [k for k in weights[0] if k.endswith("lora_B.weight")]
        assert trained and all(weights[0][k].abs().sum() > 0 for k in trained)
