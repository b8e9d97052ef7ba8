"""ember.data.jsonl: the one reader of .jsonl/.json rows (training documents, DPO pairs, eval rows)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ember.data.jsonl import json_rows, read_json_rows
from ember.errors import DataError


def test_rows_come_with_their_line_skipping_blank_lines(tmp_path: Path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": 1}\n\n  \n{"a": 2}\n')
    assert read_json_rows(path, "test data") == [(f"{path} line 1", {"a": 1}), (f"{path} line 4", {"a": 2})]


def test_a_json_file_is_an_array_or_one_object(tmp_path: Path):
    path = tmp_path / "rows.json"
    assert list(json_rows(path, '[{"a": 1}, {"a": 2}]')) == [(f"{path} item 0", {"a": 1}), (f"{path} item 1", {"a": 2})]
    assert list(json_rows(path, '{"a": 1}')) == [(f"{path} item 0", {"a": 1})]


@pytest.mark.parametrize("name, text, message", [
    ("rows.jsonl", '{"a": 1}\n{"a": \n', "line 2 is not valid JSON (Expecting value); fix or remove that line"),
    ("rows.jsonl", '{"a": 1}\n[1, 2]\n', "line 2 is an array, not a JSON object; each row must be one {...} object"),
    ("rows.jsonl", '"text"\n', "line 1 is a string, not a JSON object; each row must be one {...} object"),
    ("rows.json", '[{"a": 1}, null]', "item 1 is null, not a JSON object; each row must be one {...} object"),
    ("rows.json", '[{"a": 1},', "is not valid JSON (Expecting value at line 1); fix the file"),
])
def test_a_bad_row_is_one_line_naming_file_and_line(tmp_path: Path, name: str, text: str, message: str):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(DataError, match=f"^{re.escape(f'{path} {message}')}$"):
        read_json_rows(path, "test data")


def test_text_that_is_not_utf8_names_the_file_s_role(tmp_path: Path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"a": "\xe9"}\n')
    with pytest.raises(DataError, match=f"^{re.escape(f'DPO data {chr(39)}{path}{chr(39)} is not UTF-8 text')}$"):
        read_json_rows(path, "DPO data")
