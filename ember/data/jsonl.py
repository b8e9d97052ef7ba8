"""Rows of a JSON Lines (.jsonl) or JSON (.json) file: the one reader of training documents, DPO pairs, eval
task rows and generate's prompt files.

Each row comes with where it is ("FILE line N", or "FILE item I" in a .json array), so a caller's own error
about a row (a missing field, a bad value) names the line to fix; a line that is not JSON, or is JSON but not
an object, is a one-line DataError here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from ember.errors import DataError

# A row's JSON type as JSON names it, for the error about a row that is not an object.
_JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
               type(None): "null"}


def _object(row: Any, where: str) -> dict:
    if not isinstance(row, dict):
        raise DataError(f"{where} is {_JSON_TYPES.get(type(row), type(row).__name__)}, not a JSON object; "
                        "each row must be one {...} object")
    return row


def json_rows(path: Path, text: str) -> Iterator[tuple[str, dict]]:
    """(where, row) of every row of `text`, the content of `path`: each non-blank line of a .jsonl file, or
    the items of a .json file's array (a single object is one row)."""
    if path.suffix != ".json":
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path} line {lineno} is not valid JSON ({err.msg}); "
                                "fix or remove that line") from None
            yield f"{path} line {lineno}", _object(row, f"{path} line {lineno}")
        return
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(f"{path} is not valid JSON ({err.msg} at line {err.lineno}); fix the file") from None
    for i, row in enumerate(data if isinstance(data, list) else [data]):
        yield f"{path} item {i}", _object(row, f"{path} item {i}")


def read_json_rows(path: Path, what: str) -> list[tuple[str, dict]]:
    """(where, row) of every row of the .jsonl or .json file `path`; `what` names the file's role (e.g.
    "DPO data") in the error for a file that is not UTF-8 text."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{what} '{path}' is not UTF-8 text") from None
    return list(json_rows(path, text))
