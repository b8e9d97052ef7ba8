"""first_error_line: the one way ember shortens an exception to the gist a one-line error quotes."""

from __future__ import annotations

from ember.errors import first_error_line


def test_first_non_empty_line_stripped():
    assert first_error_line(ValueError("\n  bad header  \n  at byte 12\n")) == "bad header"
    assert first_error_line(OSError("disk full")) == "disk full"


def test_empty_text_gives_the_type_name():
    assert first_error_line(ValueError()) == "ValueError"
    assert first_error_line(RuntimeError(" \n ")) == "RuntimeError"


def test_a_heading_line_takes_the_next_line_with_it():
    err = RuntimeError('Error(s) in loading state_dict for Decoder:\n\tMissing key(s) in state_dict: "norm.weight".\n'
                       '\tUnexpected key(s) in state_dict: "x".')
    assert first_error_line(err) == ('Error(s) in loading state_dict for Decoder: '
                                     'Missing key(s) in state_dict: "norm.weight".')


def test_a_checkpoint_exception_gives_the_first_rank_s_own_error():
    class CheckpointException(Exception):  # DCP's shape: {rank: (exception, traceback)}, a traceback per rank in str
        def __init__(self) -> None:
            super().__init__("CheckpointException ranks:dict_keys([0, 1])\nTraceback (most recent call last): ...")
            self.failures = {0: (FileNotFoundError("no such file: __0_0.distcp"), "tb"), 1: (OSError("other"), "tb")}

    assert first_error_line(CheckpointException()) == "no such file: __0_0.distcp"
