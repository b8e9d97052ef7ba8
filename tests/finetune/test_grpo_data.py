"""GRPO's prompts (ember/finetune/grpo_data.py): rows from a jsonl (text or chat prompts) and from reasoning-gym's
seeded generators, each bad row one line naming its place, and a loader whose ranks take disjoint prompts and
whose state resumes the order exactly."""

import json

import pytest

from ember.errors import ConfigError, DataError
from ember.finetune.grpo_data import PromptLoader, PromptRow, load_prompts


def _encode(row: dict) -> list[int]:  # a stand-in tokenizer: one id per word of the prompt or of the messages
    text = row["prompt"] if "prompt" in row else " ".join(m["content"] for m in row["messages"])
    return [len(word) for word in text.split()]


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_rows_from_a_jsonl_text_or_chat(tmp_path):
    spec = _write(tmp_path / "p.jsonl", [{"prompt": "two plus two", "answer": "4"},
                                         {"messages": [{"role": "user", "content": "one plus one"}], "answer": "2"}])
    rows = load_prompts(spec, _encode, ["answer"], max_prompt_tokens=8)
    assert [r.prompt_ids for r in rows] == [[3, 4, 3], [3, 4, 3]]
    assert [r.row["answer"] for r in rows] == ["4", "2"] and rows[1].where.endswith("p.jsonl line 2")


def test_rows_from_parquet_and_another_prompt_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"question": ["two plus two", "one plus one"], "answer": ["4", "2"]})
    pq.write_table(table, tmp_path / "p.parquet")
    rows = load_prompts(str(tmp_path / "p.parquet"), lambda row: [len(w) for w in row["question"].split()], ["answer"],
                        max_prompt_tokens=8, prompt_field="question")
    assert [r.prompt_ids for r in rows] == [[3, 4, 3], [3, 4, 3]] and [r.row["answer"] for r in rows] == ["4", "2"]
    assert rows[1].where.endswith("p.parquet row 2")
    with pytest.raises(DataError, match="no 'prompt' .text or messages. or 'messages'"):
        load_prompts(str(tmp_path / "p.parquet"), _encode, [], max_prompt_tokens=8)


@pytest.mark.parametrize("rows, message", [
    ([{"answer": "4"}], "p.jsonl line 1: no 'prompt' (text or messages) or 'messages'"),
    ([{"prompt": "a"}, {"prompt": "b"}], "p.jsonl line 1: no 'answer', which the rewards read (grpo.rewards)"),
    ([{"prompt": "a b c d e f g h i", "answer": "x"}], "p.jsonl line 1: the prompt is 9 tokens, more than seq_len - "
                                                       "grpo.max_new_tokens = 8"),
])
def test_a_bad_row_is_one_line_naming_it(tmp_path, rows, message):
    spec = _write(tmp_path / "p.jsonl", rows)
    with pytest.raises(DataError) as err:
        load_prompts(spec, _encode, ["answer"], max_prompt_tokens=8)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_reasoning_gym_rows_are_seeded_and_carry_their_answer():
    rows = load_prompts("reasoning_gym:basic_arithmetic", _encode, ["answer"], 64, gym_size=20, seed=1)
    again = load_prompts("reasoning_gym:basic_arithmetic", _encode, ["answer"], 64, gym_size=20, seed=1)
    assert len(rows) == 20 and [r.row for r in rows] == [r.row for r in again]
    assert rows[0].row["prompt"].startswith("Calculate") and rows[0].where == "reasoning_gym:basic_arithmetic:0"
    with pytest.raises(ConfigError, match="reasoning-gym cannot make generator .no_such_task."):
        load_prompts("reasoning_gym:no_such_task", _encode, [], 64)


def test_ranks_take_disjoint_prompts_and_a_resume_continues_the_order():
    prompts = [PromptRow([i], {"i": i}, f"r{i}") for i in range(10)]
    ranks = [PromptLoader(prompts, 2, dp_rank=r, dp_world=2, seed=3) for r in range(2)]
    epoch = [[p.row["i"] for loader in ranks for p in loader.next_batch()] for _ in range(2)]
    seen = epoch[0] + epoch[1]
    assert len(set(seen)) == 8  # two global batches of 4, none twice; the tail of 2 is left out
    one = PromptLoader(prompts, 2, seed=3)
    for _ in range(3):
        one.next_batch()
    resumed = PromptLoader(prompts, 2, seed=3)
    resumed.load_state_dict(one.state_dict())
    for _ in range(6):  # through the next epoch's start
        assert [p.row for p in resumed.next_batch()] == [p.row for p in one.next_batch()]
    loader = PromptLoader(prompts, 2, seed=3)
    epochs = [[p.row["i"] for _ in range(5) for p in loader.next_batch()] for _ in range(2)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(10)) and epochs[0] != epochs[1]  # a new order
    with pytest.raises(DataError, match="10 prompts are fewer than one step's 12"):
        PromptLoader(prompts, 6, dp_world=2)
