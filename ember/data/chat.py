"""Chat SFT data: conversations rendered with a chat template, trained on the assistant turns only.

A row holds a list of messages, `{"role": "system" | "user" | "assistant", "content": str}` (the
OpenAI-style format most SFT sets use). The conversation is rendered to text by a Jinja chat template the
way transformers renders it (a sandboxed environment with trim_blocks/lstrip_blocks, raise_exception,
strftime_now, its tojson, the tokenizer's special tokens as variables) and encoded with special tokens
recognised, so the ids equal `PreTrainedTokenizerFast.apply_chat_template(messages, tokenize=True)`.

Which tokens are trained. Each assistant message's text, from the end of its generation prompt (e.g.
`<|start_header_id|>assistant<|end_header_id|>\\n\\n`) through the end-of-turn marker the template writes
after it (`<|eot_id|>`, `<|im_end|>`: trained, so the model learns to stop), is found by rendering prefixes
of the conversation: render(messages[:i], add_generation_prompt=True) ends where assistant message i starts,
render(messages[:i+1]) ends where it stops (trailing whitespace after the marker left out). This works for
any template whose rendering of a prefix is a prefix of the whole rendering, which is most of them, and needs
no `{% generation %}` markup (few hub templates have it). A template for which this does not hold (it ignores
add_generation_prompt, rewrites earlier turns as the conversation grows, or drops the assistant's text) is
refused, saying so, rather than trained on a wrong mask. Character spans become token labels through the
tokenizer's offsets: a token is a target when it overlaps a span, as transformers' `assistant_masks` does.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

from ember.config_schema import DataConfig, JobConfig
from ember.errors import ConfigError, DataError, first_error_line

if TYPE_CHECKING:
    import jinja2
    import numpy.typing as npt
    import tokenizers

ROLES = ("system", "user", "assistant")
AUTO = "auto"
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

# Built-in templates, for a tokenizer directory that has none (a base model's). llama3: the template of
# Meta-Llama-3-8B-Instruct's tokenizer_config.json; chatml: the ChatML template transformers documents.
BUILTIN_TEMPLATES = {
    "llama3": (
        "{% set loop_messages = messages %}{% for message in loop_messages %}"
        "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
        "+ message['content'] | trim + '<|eot_id|>' %}"
        "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
    "chatml": (
        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
        " + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
}
TEMPLATE_CHOICES = (AUTO, *BUILTIN_TEMPLATES)


@dataclass(frozen=True)
class ChatTemplate:
    name: str  # for messages: "built-in llama3" or the file it came from
    source: str  # the Jinja text
    variables: tuple[tuple[str, str], ...]  # the special tokens every render sees (bos_token, eos_token, ...)

    @property
    def identity(self) -> str:
        """Changes when the rendering could: keys the token cache (the tokenizer's identity does not cover it)."""
        return hashlib.sha256(json.dumps([self.source, self.variables]).encode()).hexdigest()[:16]


def check_chat_source(data_cfg: DataConfig) -> None:
    """What chat data needs from the command line, checked when the run builds its tokenizer (before the
    model): the *-sft recipes load without them, so `ember recipes` lists them."""
    if data_cfg.tokenizer is None:
        raise DataError("data.messages_field (chat SFT) needs the model's tokenizer and chat template: set "
                        "model.init_from=DIR, a Hugging Face model folder (the *-sft recipes read its tokenizer), "
                        "or data.tokenizer=DIR")
    if data_cfg.dataset in ("embedded", "synthetic") and not getattr(data_cfg, "mixture", None):
        raise DataError(f"data.messages_field (chat SFT) reads conversations from a file or hub dataset, not "
                        f"data.dataset={data_cfg.dataset}; set data.dataset=chat.jsonl (rows with a "
                        f"'{data_cfg.messages_field}' list)")


# ---------------------------------------------------------------- messages
def check_messages(value: Any, where: str) -> list[dict]:
    """A row's messages, checked: a list of {role, content} dicts with known roles and an assistant turn.
    Keys whose value is null are dropped (columnar files fill absent keys with null), as transformers does."""
    if not isinstance(value, (list, tuple)) or not value:
        raise DataError(f"{where} is {type(value).__name__ if value else 'empty'}, not a list of messages "
                        '({"role": ..., "content": ...}); fix the row or set data.messages_field')
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or "role" not in message or not isinstance(message.get("content"), str):
            raise DataError(f'{where} message {i} is not a {{"role": ..., "content": "text"}} object; fix the row')
        if message["role"] not in ROLES:
            raise DataError(f"{where} message {i} has role '{message['role']}'; roles are {', '.join(ROLES)}")
        messages.append({k: v for k, v in message.items() if v is not None})
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where} has no assistant message, and only assistant turns are trained; "
                        "add one or remove the row")
    return messages


# ---------------------------------------------------------------- templates
def _tojson(x: Any, ensure_ascii: bool = False, indent: Optional[int] = None,
            separators: Optional[tuple[str, str]] = None,
            sort_keys: bool = False) -> str:
    # transformers' filter: Jinja's own escapes HTML characters, which a chat is not.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    """The template compiled in a sandbox: a hub template is untrusted text and must not reach Python objects."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        # transformers' `{% generation %}...{% endgeneration %}` tag: rendered as its body (the spans come from
        # prefix renders, so its tracking is not needed), so templates that use it render here too.
        tags = {"generation"}

        def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Callable[[], str]) -> str:
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _token_text(value: Any) -> Optional[str]:
    value = value.get("content") if isinstance(value, dict) else value  # older files nest it
    return value if isinstance(value, str) else None


def load_template(choice: Optional[str], tokenizer: Any) -> ChatTemplate:
    """data.chat_template -> the template: auto (or None) is the tokenizer directory's (chat_template.jinja,
    else tokenizer_config.json's chat_template, as transformers loads them); a built-in name is that one."""
    choice = choice or AUTO
    if choice not in TEMPLATE_CHOICES:
        raise DataError(f"data.chat_template '{choice}' is not one of {', '.join(TEMPLATE_CHOICES)}")
    # The folder of the tokenizer's file; the embedded BPE has none (its source is a description).
    folder = Path(tokenizer.source).parent if Path(tokenizer.source).is_file() else None
    config: dict = {}
    config_path = folder / "tokenizer_config.json" if folder else Path()
    if folder and config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError):
            raise DataError(f"'{config_path}' is not valid JSON; fix or remove it") from None
        config = config if isinstance(config, dict) else {}
    variables = {key: text for key in SPECIAL_TOKEN_KEYS if (text := _token_text(config.get(key))) is not None}
    if choice != AUTO:
        # A base model's directory may name no special tokens: take them from the tokenizer itself.
        tok = getattr(tokenizer, "tok", None)
        for key, token_id in (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id)):
            if key not in variables and token_id is not None and tok is not None:
                variables[key] = tok.id_to_token(token_id)
        return ChatTemplate(f"built-in {choice}", BUILTIN_TEMPLATES[choice], tuple(sorted(variables.items())))
    if folder is None:
        raise DataError(f"the tokenizer ({tokenizer.source}) has no folder to read a chat template from; set "
                        f"data.chat_template to a built-in ({', '.join(BUILTIN_TEMPLATES)}) or data.tokenizer")
    jinja_path = folder / "chat_template.jinja"
    source: Any = None
    if jinja_path.is_file():
        source, name = jinja_path.read_text(encoding="utf-8"), str(jinja_path)
    elif "chat_template" in config:
        source, name = config["chat_template"], str(config_path)
        if isinstance(source, list):  # several named templates: the default one, as transformers picks it
            source = next((t.get("template") for t in source
                           if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(source, str) or not source:
        raise DataError(f"the tokenizer at {folder} has no chat template (no chat_template.jinja, no chat_template in "
                        f"tokenizer_config.json); set data.chat_template to a built-in: {', '.join(BUILTIN_TEMPLATES)}")
    return ChatTemplate(name, source, tuple(sorted(variables.items())))


def render(template: ChatTemplate, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The conversation as the template writes it (transformers' render_jinja_template, one conversation)."""
    import jinja2

    try:
        compiled = _compile(template.source)
        return compiled.render(messages=messages, tools=None, documents=None,
                               add_generation_prompt=add_generation_prompt, **dict(template.variables))
    except jinja2.TemplateError as err:
        raise DataError(f"chat template {template.name} failed: {first_error_line(err)}; "
                        "fix the conversation or the template") from None


# ---------------------------------------------------------------- assistant spans and labels
def assistant_spans(template: ChatTemplate, messages: list[dict], text: str) -> list[tuple[int, int]]:
    """[start, end) character spans of `text` (the whole rendering) that the loss covers: each assistant
    message's content and the end-of-turn marker after it (see the module docstring for the method)."""
    spans = []
    cannot = f"chat template {template.name} cannot mark the assistant spans"
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(template, messages[:i], add_generation_prompt=True)
        through = render(template, messages[: i + 1])
        if before == render(template, messages[:i]):
            raise DataError(f"{cannot}: it ignores add_generation_prompt, so where an assistant turn starts is "
                            "unknown; use a template that writes the assistant header for it, or a built-in")
        if not (through.startswith(before) and text.startswith(through)):
            raise DataError(f"{cannot}: rendering the conversation up to message {i} is not a prefix of rendering "
                            "all of it (the template rewrites earlier turns); use another template or a built-in")
        end = len(through.rstrip())  # the newline a template writes after the end-of-turn marker is not trained
        if message["content"].strip() not in text[len(before) : end]:
            raise DataError(f"{cannot}: assistant message {i}'s content is not in its rendered turn; "
                            "use another template or a built-in")
        spans.append((len(before), end))
    return spans


def chat_encoder(tokenizer: Any) -> tokenizers.Tokenizer:
    """A copy of the tokenizer that reads the template's special-token text as special tokens.

    ember's Tokenizer encodes special-token text as plain text (a document is data); a rendered chat is
    not, and transformers encodes it with special tokens recognised. A copy, so the shared tokenizer keeps
    its setting while a prefetch thread uses it."""
    tok = getattr(tokenizer, "tok", None)
    if tok is None:
        raise DataError(f"chat data needs a Hugging Face tokenizer.json (its offsets place the assistant tokens); "
                        f"the tokenizer is {tokenizer.source}: point data.tokenizer at a tokenizer.json or its folder")
    import tokenizers

    encoder = tokenizers.Tokenizer.from_str(tok.to_str())
    encoder.encode_special_tokens = False
    return encoder


def _labels(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """1 on every token whose character range overlaps a span, as transformers' assistant_masks."""
    mask = np.zeros(len(offsets), np.uint8)
    j = 0
    # Spans and offsets both ascend, so one pass: skip spans that end before the token, mark an overlap.
    for t, (start, end) in enumerate(offsets):
        while j < len(spans) and start >= spans[j][1]:
            j += 1
        if j == len(spans):
            break
        if end > spans[j][0]:
            mask[t] = 1
    return mask


def encode_conversation(template: ChatTemplate, encoder: tokenizers.Tokenizer,
                        messages: list[dict]) -> tuple[list[int], np.ndarray]:
    """(ids, mask): the ids apply_chat_template gives, and 1 on every token the loss covers."""
    text = render(template, messages)
    encoding = encoder.encode(text, add_special_tokens=False)
    return encoding.ids, _labels(encoding.offsets, assistant_spans(template, messages, text))


ENCODE_BATCH = 256  # conversations per encode_batch call: the Rust encoder spreads them over all cores


def encode_conversations(conversations: list[list[dict]], tokenizer: Any, template: ChatTemplate,
                         dtype: npt.DTypeLike = np.uint32) -> list[tuple[np.ndarray, np.ndarray]]:
    """One (tokens, mask) per conversation, each ending with the tokenizer's EOS (the document separator
    packing and document masking read; not a target, since the end-of-turn marker already teaches stopping).
    A rendering that already ends with EOS gets no second one."""
    encoder = chat_encoder(tokenizer)
    out = []
    for start in range(0, len(conversations), ENCODE_BATCH):
        batch = conversations[start : start + ENCODE_BATCH]
        texts = [render(template, messages) for messages in batch]
        spans = [assistant_spans(template, messages, text) for messages, text in zip(batch, texts)]
        for encoding, doc_spans in zip(encoder.encode_batch(texts, add_special_tokens=False), spans):
            ids, mask = encoding.ids, _labels(encoding.offsets, doc_spans)
            if not ids or ids[-1] != tokenizer.eos_id:
                ids, mask = ids + [tokenizer.eos_id], np.append(mask, np.uint8(0))
            out.append((np.asarray(ids, dtype=dtype), mask))
    return out


def check(cfg: JobConfig) -> None:
    """Chat SFT (data.messages_field, data.chat_template) and data.packing, against the rest of the config
    (ember.train.run.load_config calls this)."""
    data = cfg.data
    if data.chat_template not in TEMPLATE_CHOICES:
        raise ConfigError(f"data.chat_template '{data.chat_template}' is not one of {', '.join(TEMPLATE_CHOICES)} "
                          "(auto: the tokenizer folder's own template)")
    if data.messages_field is not None:
        if data.prompt_field:
            raise ConfigError("data.messages_field (chat rows) and data.prompt_field (prompt/response rows) exclude "
                              "each other; set one of them")
        if data.streaming:
            raise ConfigError("data.messages_field (chat SFT) reads whole files; set data.streaming=false")
        if data.dataset == "synthetic" and not data.mixture:
            raise ConfigError("data.messages_field (chat SFT) reads conversations, and synthetic tokens have none; "
                              "set data.dataset=chat.jsonl")
        # A missing tokenizer or dataset is refused when the run builds its tokenizer (chat.check_chat_source),
        # before the model: the *-sft recipes leave both to the command line and still load for `ember recipes`.
    if not data.packing and (data.streaming or (data.dataset == "synthetic" and not data.mixture)):
        raise ConfigError("data.packing=false pads each document, read whole; synthetic tokens and streamed data "
                          "have none: set data.packing=true")
