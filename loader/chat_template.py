"""Chat templates (`tokenizer.chat_template`, Jinja2) rendered with Hugging Face semantics.

Like transformers' `apply_chat_template`: an ImmutableSandboxedEnvironment with trim_blocks,
lstrip_blocks and the loopcontrols extension; the variables messages, tools,
add_generation_prompt, bos_token, eos_token (plus any extra keyword); `tojson` is
`json.dumps(x, ensure_ascii=False)` (keys kept in order, no HTML escaping, optional indent);
`raise_exception(msg)` and `strftime_now(fmt)` are globals; `{% generation %}` blocks render their
body.

`render()` gives the prompt text (tokenize it with parse_special=True). `render_marked()` with
`ControlTokens.encode()` is the injection-safe form: a control-token text written in a message (e.g. a
user typing "<|im_start|>system") becomes ordinary tokens, and only the template's own markup becomes
control tokens (see control_tokens.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .control_tokens import ControlTokens, MarkedPrompt


class ChatTemplateError(ValueError):
    """A template that does not compile or fails while rendering, a raise_exception() call from the
    template, or messages of the wrong shape."""


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str = "") -> None:
    raise ChatTemplateError(f"chat template error: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant text for training masks in
    transformers); rendering just outputs the body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _check_messages(messages: Any) -> list:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(f"messages must be a list of dicts, not {type(messages).__name__}")
    for k, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"messages[{k}] must be a dict, not {type(m).__name__}")
        if not isinstance(m.get("role"), str):
            raise ChatTemplateError(f"messages[{k}] has no 'role' string")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, Sequence)):
            raise ChatTemplateError(f"messages[{k}]['content'] must be a string, a list of parts "
                                    f"or null, not {type(content).__name__}")
    return list(messages)


class ChatTemplate:
    """A compiled chat template. `render()` gives the prompt text, to be tokenized with
    parse_special=True."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        if not isinstance(source, str) or not source:
            raise ChatTemplateError("the chat template is empty")
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template syntax error at line {e.lineno}: {e.message}") from e

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], tokenizer=None, source: str = "<gguf>",
                           name: str | None = None) -> "ChatTemplate":
        """The template stored in `tokenizer.chat_template` (or `tokenizer.chat_template.NAME`),
        with bos/eos token texts taken from `tokenizer` when given."""
        key = "tokenizer.chat_template" + (f".{name}" if name else "")
        text = meta.get(key)
        if not text:
            raise ChatTemplateError(f"{source}: {key} is missing")
        bos = eos = ""
        if tokenizer is not None:
            if tokenizer.bos_id is not None:
                bos = tokenizer.token_text(tokenizer.bos_id)
            if tokenizer.eos_id is not None:
                eos = tokenizer.token_text(tokenizer.eos_id)
        try:
            return cls(text, bos_token=bos, eos_token=eos)
        except ChatTemplateError as e:
            raise ChatTemplateError(f"{source}: {key}: {e}") from e

    def render(self, messages: list[dict], tools: list[dict] | None = None,
               add_generation_prompt: bool = True, **extra) -> str:
        messages = _check_messages(messages)
        if tools is not None and (isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence)):
            raise ChatTemplateError(f"tools must be a list of dicts, not {type(tools).__name__}")
        context = dict(bos_token=self.bos_token, eos_token=self.eos_token)
        context.update(extra)
        context.update(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt)
        try:
            return self._template.render(**context)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as e:
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e
        except (RecursionError, OverflowError, MemoryError) as e:     # deep or huge inputs
            raise ChatTemplateError("chat template failed: the messages or tools are nested too deeply "
                                    "or too large") from e

    def render_marked(self, messages: list[dict], controls: ControlTokens, tools: list[dict] | None = None,
                      add_generation_prompt: bool = True, **extra) -> MarkedPrompt:
        """Render with every control-token text inside the inputs (message fields, tool calls, tools, at
        any depth, keys too) marked as plain text; `controls.encode(tokenizer, result)` tokenizes it."""
        mark = controls.free_mark([messages, tools, extra, self.source, self.bos_token, self.eos_token])
        if mark is None:
            raise ChatTemplateError("the messages use every private-use character; the prompt cannot be "
                                    "tokenized safely")
        text = self.render(controls.mark_inputs(messages, mark),
                           tools=None if tools is None else controls.mark_inputs(tools, mark),
                           add_generation_prompt=add_generation_prompt, **extra)
        return MarkedPrompt.from_rendered(text, mark)
