"""GLaM has no Hugging Face counterpart: transformers has no GLaM model class and Google released no GLaM
weights, so there is no config or key map to convert to or from. ModelSpec requires an `hf` module (an
HFMapping); its conversions say so clearly (`ember convert CKPT --to hf` fails with this message) instead of
inventing a format. GLaM checkpoints are ember DCP checkpoints (or torch.save files via `ember convert --to torch`).
"""

from __future__ import annotations

from typing import Any, NoReturn

from ember.models.glam.args import GlamArgs

NO_HF = ("the GLaM family has no Hugging Face format (transformers has no GLaM model class); keep it as an "
         "ember checkpoint, or use `ember convert CKPT OUT.pt --to torch`")


def _no_hf(*_: Any, **__: Any) -> NoReturn:
    raise ValueError(NO_HF)


args_from_hf_config = hf_config_from_args = from_hf_state_dict = to_hf_state_dict = _no_hf


def family_of(args: GlamArgs) -> str:
    return "glam"
