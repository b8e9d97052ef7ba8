"""GRPO's rewards (ember/finetune/grpo_rewards.py): the built-ins on hand-checked answers, a user's module:function,
weights, and a reward that raises or hangs: one line naming the function and the row, or 0 and counted."""

import pytest
import torch

from ember.errors import ConfigError
from ember.finetune.grpo_rewards import RewardError, build_rewards, final_answer, normalize


@pytest.mark.parametrize("completion, answer", [
    ("so the total is #### 1,000.", "1000"), ("The answer: \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
    ("  Paris ", "paris"), ("$42$", "42")])
def test_exact_matches_the_normalized_final_answer(completion, answer):
    rewards = build_rewards(["exact"], None, None)
    total, _ = rewards.score(["q"], [completion], [{"answer": answer}], ["data.jsonl:1"])
    assert total.tolist() == [1.0]


def test_final_answer_and_normalize_by_hand():
    assert final_answer("a \\boxed{1} then \\boxed{x^{2}}") == "x^{2}"
    assert final_answer("work #### 7 #### 8") == " 8"
    assert normalize(" The  Answer is 1,234,567. ") == "the answer is 1234567"


def test_math_finds_equal_values_written_differently():
    rewards = build_rewards(["math"], None, None)
    rows = [{"answer": "\\frac{1}{2}"}, {"answer": "3"}, {"answer": "0.5"}]
    completions = ["so $0.5$", "it is 4", "\\boxed{\\frac{2}{4}}"]
    total, _ = rewards.score(["q"] * 3, completions, rows, ["r1", "r2", "r3"])
    assert total.tolist() == [1.0, 0.0, 1.0]


def test_weights_combine_the_rewards_and_format_matches_the_whole_completion():
    rewards = build_rewards(["exact", "format"], [1.0, 0.5], r"<think>.*</think>\s*<answer>.*</answer>")
    completions = ["<think>two\nplus two</think> <answer>4</answer>", "<answer>4</answer>", "4"]
    total, per = rewards.score(["q"] * 3, completions, [{"answer": "4"}] * 3, ["a", "b", "c"])
    assert per.tolist() == [[0.0, 1.0], [0.0, 0.0], [1.0, 0.0]]
    assert torch.equal(total, torch.tensor([0.5, 0.0, 1.0]))


def test_a_users_reward_and_its_failures(tmp_path, monkeypatch):
    (tmp_path / "user_rewards.py").write_text(
        "import time\n"
        "def length(prompt, completion, row):\n    return len(completion) / row['scale']\n"
        "def hang(prompt, completion, row):\n    time.sleep(30)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rewards = build_rewards(["user_rewards:length"], None, None)
    assert rewards.score(["q"], ["abcd"], [{"scale": 2}], ["x"])[0].tolist() == [2.0]
    with pytest.raises(RewardError) as err:
        rewards.score(["q"], ["abcd"], [{}], ["train.jsonl:7"])
    assert "reward user_rewards:length failed on train.jsonl:7: KeyError" in str(err.value)
    assert "\n" not in str(err.value)
    forgiving = build_rewards(["user_rewards:length"], None, None, on_error="zero")
    assert forgiving.score(["q", "q"], ["ab", "abcd"], [{}, {"scale": 4}], ["l1", "l2"])[0].tolist() == [0.0, 1.0]
    assert forgiving.errors == [1]
    hanging = build_rewards(["user_rewards:hang"], None, None)
    hanging.timeout_s = 0.2
    with pytest.raises(RewardError, match="reward user_rewards:hang failed on row 3: TimeoutError: ran past 0.2 s"):
        hanging.score(["q"], ["c"], [{}], ["row 3"])


@pytest.mark.parametrize("names, weights, pattern, message", [
    (["nosuch"], None, None, "reward 'nosuch': choose one of exact, math, format, or give module:function"),
    (["no_such_module_x:f"], None, None, "reward 'no_such_module_x:f': cannot import no_such_module_x"),
    (["json:no_such_function"], None, None, "json has no function no_such_function"),
    (["exact", "math"], [1.0], None, "grpo.reward_weights has 1 values for 2 grpo.rewards"),
    (["format"], None, None, "the format reward needs grpo.format_pattern"),
    (["format"], None, "(", "grpo.format_pattern '(' is not a regular expression"),
    ([], None, None, "grpo.rewards is empty"),
])
def test_bad_rewards_are_one_line(names, weights, pattern, message):
    with pytest.raises(ConfigError) as err:
        build_rewards(names, weights, pattern)
    assert message in str(err.value) and "\n" not in str(err.value)
