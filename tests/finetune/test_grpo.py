"""task=grpo end to end (ember/finetune/grpo.py): a tiny policy learns what its reward asks for, a resume between the
iterations of one rollout batch continues exactly, a group of equal rewards moves nothing, failing rewards are
one line (or counted), and every bad input is refused before any work."""

from pathlib import Path

import pytest
import torch

from ember.errors import ConfigError, DataError
from ember.finetune.grpo_rewards import RewardError
from ember.train import run as run_lib
from ember.train.trainer import Trainer
from tests.finetune.grpo_fixtures import say_prompts, word_tokenizer
from tests.helpers import read_records, run_ember, tiny_model, write_jsonl

FIXTURES = "tests.finetune.grpo_fixtures"
TINY = [*tiny_model(2), "model.vocab_size=16", "seq_len=16", "global_batch_size=16", "micro_batch_size=8",
        "grpo.group_size=8", "grpo.max_new_tokens=6", "optim.lr=1e-2", "schedule.warmup_steps=0",
        "metrics.console=false", "logging_steps=1", "precision=fp32"]


@pytest.fixture(scope="module")
def words(tmp_path_factory) -> list[str]:
    """The overrides of a GRPO run on the word tokenizer's prompts, rewarded for saying `yes`."""
    folder = tmp_path_factory.mktemp("words")
    return ["task=grpo", f"data.dataset={say_prompts(folder / 'say.jsonl')}",
            f"data.tokenizer={word_tokenizer(folder / 'tok')}", f"grpo.rewards=[{FIXTURES}:yes_fraction]", *TINY]


def _train(out: Path, overrides: list[str]) -> tuple[Trainer, list[dict]]:
    trainer = Trainer(run_lib.load_config("debug", [*overrides, f"output_dir={out}"]))
    trainer.train()
    return trainer, [r for r in read_records(out) if "grpo/reward" in r]


def test_the_policy_learns_what_its_reward_asks_for(words, tmp_path):
    _, records = _train(tmp_path / "run", [*words, "max_steps=8"])
    rewards = [r["grpo/reward"] for r in records]
    assert rewards[0] < 0.3 and sum(rewards[-3:]) / 3 > 0.9, rewards
    first = records[0]
    assert first["grpo/reward_std"] > 0 and first["grpo/clipped_low"] == first["grpo/clipped_high"] == 0
    assert 0 < first["grpo/completion_length"] <= first["grpo/completion_length_max"] <= 6
    assert first["grpo/rollout_tokens_per_s"] > 0 and first["grpo/update_tokens_per_s"] > 0
    assert "grpo/accuracy/yes_fraction" not in first  # a fraction, not a 0/1 reward: no accuracy
    # tokens_seen counts the rows trained on (prompt and completion), not global_batch_size x seq_len
    assert first["tokens_seen"] < 16 * 16 and records[1]["tokens_seen"] > first["tokens_seen"]
    from ember.report import build_report

    plots = {plot.name: plot for plot in build_report([tmp_path / "run"]).plots}
    assert plots["grpo_reward"].series["run"]["grpo/reward"] == {"x": list(range(1, 9)), "y": rewards}
    assert {"grpo_completions", "grpo_policy", "grpo_time"} <= set(plots)


def test_a_resume_between_iterations_of_one_rollout_batch_equals_the_straight_run(words, tmp_path):
    """grpo.iterations=2: steps 3 and 4 train on one rollout batch; stopping after step 3 keeps its rows (and the
    sampler's place) in the checkpoint, so the resumed steps 4-6 equal the straight run's, and so do the weights."""
    common = [*words, "grpo.iterations=2", "max_steps=6", "schedule.name=constant"]  # (max_steps moves no lr)
    straight, _ = _train(tmp_path / "straight", common)
    _train(tmp_path / "resumed", [*common, "max_steps=3"])
    resumed, _ = _train(tmp_path / "resumed", common)
    def by_step(run: Path) -> dict[int, tuple]:
        return {r["step"]: (r["loss"], r["grad_norm"], r.get("grpo/reward")) for r in read_records(run) if "loss" in r}
    straight_steps, resumed_steps = by_step(tmp_path / "straight"), by_step(tmp_path / "resumed")
    assert [resumed_steps[s] for s in (4, 5, 6)] == [straight_steps[s] for s in (4, 5, 6)]
    assert straight_steps[4][2] is None and straight_steps[5][2] is not None  # step 4 reused step 3's rollouts
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
    state = torch.load(tmp_path / "resumed" / "checkpoints" / "step-3" / "train-rank0.pt", weights_only=True)
    assert state["data"]["rows"] is not None and state["data"]["iteration"] == 1


def test_equal_rewards_in_every_group_move_no_weight(words, tmp_path):
    trainer, records = _train(tmp_path / "run", [*words, "grpo.rewards=[format]", "grpo.format_pattern=.*",
                                                 "max_steps=2"])
    start = {name: p.detach().clone() for name, p in Trainer(trainer.cfg).model.named_parameters()}
    assert [r["grpo/reward"] for r in records] == [1.0, 1.0]  # every completion matches
    assert all(r["grad_norm"] == 0 and r["grpo/zero_std_groups"] == 1 for r in records)
    assert records[0]["grpo/accuracy/format"] == 1.0  # a 0/1 reward: its mean is an accuracy
    assert all(torch.equal(p, start[name]) for name, p in trainer.model.named_parameters())


def test_beta_keeps_a_frozen_reference_and_reports_the_kl(words, tmp_path):
    _, records = _train(tmp_path / "run", [*words, "grpo.beta=0.1", "max_steps=3"])
    assert records[0]["grpo/kl"] == 0.0  # the policy is the reference until its first update
    assert records[2]["grpo/kl"] > 0


@pytest.mark.slow
def test_a_moe_policy_learns_and_counts_the_expert_load_of_its_updates_only(words, tmp_path):
    """Mixtral (8 experts, top 2): the rollouts and the no-grad log-probs run in eval mode, so the step's expert load
    is the update's tokens alone (each routed to top_k experts in every layer)."""
    trainer, records = _train(tmp_path / "run", [*words, "model.family=mixtral", "grpo.iterations=2", "max_steps=6"])
    rewards = [r["grpo/reward"] for r in records if "grpo/reward" in r]
    assert rewards[-1] > rewards[0]
    tokens = 16 * trainer.train_loader.batch.rows["inputs"].shape[1]  # every row of the last step, padding too
    load = read_records(tmp_path / "run")[-1]["moe/layer0/tokens_per_expert"]
    assert sum(load) == 2 * tokens


def test_a_failing_reward_is_one_line_or_scores_zero_and_is_counted(words, tmp_path):
    with pytest.raises(RewardError, match=rf"reward {FIXTURES}:raises failed on .*say.jsonl line \d+: ValueError: "
                                          "no score for this"):
        _train(tmp_path / "fail", [*words, f"grpo.rewards=[{FIXTURES}:raises]", "max_steps=1"])
    _, records = _train(tmp_path / "zero", [*words, f"grpo.rewards=[{FIXTURES}:raises,{FIXTURES}:yes_fraction]",
                                            "grpo.reward_errors=zero", "max_steps=1"])
    assert records[0][f"grpo/reward_errors/{FIXTURES}:raises"] == 16
    with pytest.raises(RewardError, match=rf"reward {FIXTURES}:nan failed on .*say.jsonl line \d+: ValueError: "
                                          "returned nan, not a finite number"):
        _train(tmp_path / "nan", [*words, f"grpo.rewards=[{FIXTURES}:nan]", "max_steps=1"])
    with pytest.raises(RewardError, match=r"sleeps failed on .*: TimeoutError: ran past 0.2 s"):
        _train(tmp_path / "slow", [*words, f"grpo.rewards=[{FIXTURES}:sleeps]", "grpo.reward_timeout_s=0.2",
                                   "max_steps=1"])


@pytest.mark.parametrize("overrides, message", [
    (["grpo.group_size=3"], "grpo.group_size=3 does not divide global_batch_size=16"),
    (["grpo.group_size=1"], "a group needs at least 2"),
    (["grpo.rewards=[nope]"], "reward 'nope': choose one of exact, math, format, or give module:function"),
    (["grpo.rewards=[no_such_module:f]"], "cannot import no_such_module"),
    (["grpo.rewards=[exact,math]", "grpo.reward_weights=[1.0]"], "grpo.reward_weights has 1 values for 2"),
    (["grpo.loss_type=ppo"], "grpo.loss_type 'ppo' is not one of dapo, grpo, dr_grpo"),
    (["grpo.scale_rewards=maybe"], "grpo.scale_rewards='maybe': choose group"),
    (["grpo.max_new_tokens=16"], "grpo.max_new_tokens=16 must be >= 1 and below seq_len=16"),
    (["grpo.temperature=0"], "rollouts are sampled, so it must be > 0"),
    (["grpo.reward_weights=[.nan]"], "each weight must be a finite number"),
    (["grpo.iterations=0"], "grpo.iterations=0 must be >= 1"),
    (["grpo.stop=['']"], "grpo.stop holds an empty string"),
    (["data.dataset=embedded"], "task=grpo reads prompts from data.dataset"),
    (["ici_mesh.pipeline=2"], "task=grpo scores whole sequences per rank; pipeline parallelism"),
    (["task=lm"], "grpo.max_new_tokens is set, but task=lm: grpo.* keys configure task=grpo"),
    (["grpo.compile_rollout=true", "ici_mesh.tensor=2"], "grpo.compile_rollout=true compiles the decode step of one"),
    (["grpo.compile_rollout=true", "ici_mesh.fsdp=2"], "not one over 2 data-parallel ranks"),
    (["device=xla"], "task=grpo is not supported with device=xla; use task=lm, or train DPO and GRPO on cpu/cuda"),
])
def test_bad_grpo_config_is_one_line_naming_the_key(words, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        run_lib.load_config("debug", [*words, *overrides], world_size=2 if "ici_mesh" in str(overrides) else None)


def test_each_data_parallel_rank_samples_whole_groups(words):
    with pytest.raises(ConfigError, match="grpo.group_size=8 does not divide each data-parallel rank's 4 completions"):
        run_lib.load_config("debug", [*words, "global_batch_size=8", "micro_batch_size=4"], world_size=2)


def test_bad_prompts_are_one_line_naming_the_file_and_line(words, tmp_path):
    long = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "say yes", "answer": "yes"},
                                                  {"prompt": " ".join(["a"] * 12), "answer": "yes"}])
    with pytest.raises(DataError, match=r"long.jsonl line 2: the prompt is 12 tokens, more than seq_len - "
                                        r"grpo.max_new_tokens = 10"):
        Trainer(run_lib.load_config("debug", [*words, f"data.dataset={long}", f"output_dir={tmp_path / 'a'}"]))
    bare = write_jsonl(tmp_path / "bare.jsonl", [{"prompt": "say yes"}] * 3)
    with pytest.raises(DataError, match=r"bare.jsonl line 1: no 'answer', which the rewards read"):
        Trainer(run_lib.load_config("debug", [*words, f"data.dataset={bare}", "grpo.rewards=[exact]",
                                              f"output_dir={tmp_path / 'b'}"]))
    with pytest.raises(DataError, match="2 prompts are fewer than one step.s 3 .global_batch_size"):
        Trainer(run_lib.load_config("debug", [*words, f"data.dataset={long}", "grpo.max_new_tokens=2",
                                              "global_batch_size=24", f"output_dir={tmp_path / 'c'}"]))


def test_chat_prompts_are_rendered_with_the_generation_prompt(words, tmp_path):
    rows = [{"messages": [{"role": "user", "content": "say yes ?"}], "answer": "yes"}] * 4
    chats = write_jsonl(tmp_path / "chat.jsonl", rows)
    trainer = Trainer(run_lib.load_config("debug", [*words, f"data.dataset={chats}", "data.chat_template=chatml",
                                                    "seq_len=64", "global_batch_size=8", f"output_dir={tmp_path}"]))
    prompt = trainer.train_loader.prompts.prompts[0]
    from ember.data import chat

    text = chat.render(chat.load_template("chatml", trainer.tokenizer), rows[0]["messages"],
                       add_generation_prompt=True)
    assert trainer.tokenizer.decode(prompt.prompt_ids) == trainer.tokenizer.decode(trainer.tokenizer.encode(text))
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_the_cli_refuses_before_any_work_with_exit_2(words, tmp_path):
    proc = run_ember("train", "debug", *words, f"data.dataset={tmp_path / 'missing.jsonl'}",
                     f"output_dir={tmp_path / 'run'}", expect=2)
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("error: data.dataset") and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()
    proc = run_ember("train", "debug", *words, "grpo.rewards=[no_such_module:f]", f"output_dir={tmp_path / 'run'}",
                     expect=2)
    assert proc.stderr.strip().splitlines()[-1].startswith("error: reward 'no_such_module:f': cannot import")
