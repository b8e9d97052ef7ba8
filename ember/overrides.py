"""The command line's `key=value` overrides as text, before the schema: the form `key=value`, the aliases users bring
from other frameworks, a bare key for a list key, and YAML's flow mappings with or without a space after a key's
colon. ember.config merges what this parses into the recipe."""

from __future__ import annotations

import re

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ember.errors import ConfigError, first_error_line

# Keys users may write that are Python keywords, so the dataclass field has another name.
# Other names users bring: `async` is a Python keyword; profile_step / profile_duration are torchprime's
# (profile_duration counts steps here). Giving profile_step turns profiling on, as it does there.
ALIASES = {"checkpoint.async": "checkpoint.async_save", "profile_step": "profile.step",
           "profile_duration": "profile.steps"}
IMPLIED = {"profile_step": ("profile.enabled", "true")}


def alias_overrides(overrides: list[str]) -> list[str]:
    out = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if key in IMPLIED:
            out.append("=".join(IMPLIED[key]))
        out.append(f"{ALIASES.get(key, key)}{sep}{value}")
    return out


def list_of_keys(item: str) -> str:
    """`resume_allow_changes=seed` means [seed] (one key needs no brackets); other overrides unchanged."""
    key, sep, value = item.partition("=")
    if key != "resume_allow_changes" or value.strip().startswith("["):
        return item
    return f"{key}{sep}[{value}]"


# A key of an inline mapping written without the space after its colon (`{name:choice,data:/f.jsonl}`): YAML and
# OmegaConf read `name:choice` as one key with no value, so the space is put in (a value's own colons, as in
# `data:s3://b/f`, follow no `{` or `,` and are left alone).
_TIGHT_MAPPING_KEY = re.compile(r"((?<!\$)\{\s*|,\s*)([A-Za-z_][\w.]*):(?=[^\s])")


def parse_overrides(overrides: list[str]) -> DictConfig:
    for item in overrides:
        key, sep, _ = item.partition("=")
        if not sep or not key or key.strip() != key:
            raise ConfigError(f"override '{item}' is not of the form key=value (e.g. optim.lr=3e-4)")
    try:
        return OmegaConf.from_dotlist([_spaced_mapping_keys(item) for item in overrides])
    except OmegaConfBaseException as err:
        raise ConfigError(f"cannot parse overrides: {first_error_line(err)}") from None
    except yaml.YAMLError as err:  # a value OmegaConf hands to YAML: an unclosed [ or {
        bad = next((item for item in overrides
                    if item.count("[") != item.count("]") or item.count("{") != item.count("}")), overrides[-1])
        raise ConfigError(f"cannot parse override '{bad}': {str(err).splitlines()[0]}; close every [ and {{ "
                          "(quote the whole key=value for the shell)") from None


def _spaced_mapping_keys(item: str) -> str:
    key, _, value = item.partition("=")
    # an interpolation (`${oc.env:X}`) is OmegaConf's, left as written
    return key + "=" + _TIGHT_MAPPING_KEY.sub(r"\1\2: ", value) if "{" in value and "${" not in value else item
