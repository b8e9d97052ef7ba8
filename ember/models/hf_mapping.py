"""HFMapping: how one family's hyper-parameters and weights map to and from Hugging Face transformers.

Each family's `hf.py` module is its mapping (a module satisfies a Protocol by its functions); ModelSpec.hf holds it,
and ember/model_io/hf_directory.py, load.py and convert.py call only what is declared here. GLaM, which has no HF form,
implements it by refusing each conversion in one line.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

from ember.nn.args import DecoderArgs

A = TypeVar("A", bound=DecoderArgs)  # the family's args class


@runtime_checkable
class HFMapping(Protocol[A]):
    def args_from_hf_config(self, config: dict[str, Any]) -> A:
        """The family's args for a config.json (its text config); ValueError for what ember's model cannot express."""
        ...

    def hf_config_from_args(self, args: A) -> dict[str, Any]:
        """A config.json that transformers' class loads as this model; ValueError where none can."""
        ...

    def from_hf_state_dict(self, state: dict[str, torch.Tensor], args: A) -> dict[str, torch.Tensor]:
        """HF tensors (any subset of a checkpoint's) under ember's names and layout; KeyError for a name it lacks."""
        ...

    def to_hf_state_dict(self, state: dict[str, torch.Tensor], args: A) -> dict[str, torch.Tensor]:
        """ember tensors under HF's names and layout."""
        ...

    def family_of(self, args: A) -> str:
        """The family these args are saved under: where one args class serves several families (Llama 2 and 3.x,
        Qwen2/3/3-MoE, Gemma 2/3, DeepSeek-V2/V3) the one they are closest to, which picks HF's model_type."""
        ...
