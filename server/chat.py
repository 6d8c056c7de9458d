"""OpenAI chat messages -> the prompt, rendered by the model's chat template (engine.chat_template).

Accepted message shapes (anything else is a 400 naming the field):
- {"role": "system"|"developer"|"user", "content": str | [{"type": "text", "text": str}, ...], "name"?}
  ("developer" is rendered as "system"; text parts are joined with "\\n")
- {"role": "assistant", "content": str | parts | null, "tool_calls"?: [{"id", "type": "function",
  "function": {"name": str, "arguments": JSON string}}]}: arguments are parsed into a dict before
  rendering, because templates (Qwen's) write them with `tojson`
- {"role": "tool", "content": str | parts, "tool_call_id"?: str, "name"?: str}

Sizes are checked before anything is rendered or tokenized (`check_sizes`): at most MAX_MESSAGES
messages, MAX_TOOLS tools, MAX_DEPTH levels of nesting in a tool or a tool call's arguments, MAX_CHARS
characters in all strings together, and no more content characters than n_ctx tokens can hold.

The prompt's ids come from `prompt_ids(engine, render_prompt(...))`: control-token texts written inside
messages, tool calls or tools are tokenized as plain text; only the template's markup gives control
tokens (loader/control_tokens.py).
"""
from __future__ import annotations

import json
from typing import Any

from strata_lite.loader.control_tokens import ControlTokens, MarkedPrompt
from strata_lite.loader.control_tokens import strings_in as json_strings   # every string, keys too

from .errors import APIError, bad_request

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_MESSAGES = 4096
MAX_TOOLS = 512
MAX_DEPTH = 64               # objects/arrays inside one tool (its parameters schema) or one call's arguments
MAX_CHARS = 4_000_000        # characters in all strings of messages and tools (a 1M-token context's worth)


def _text_content(content: Any, where: str, allow_null: bool) -> str:
    if content is None:
        if allow_null:
            return ""
        raise bad_request(f"{where} is required", where)
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            pw = f"{where}[{j}]"
            if not isinstance(part, dict):
                raise bad_request(f"{pw} must be an object, not {_json_type(part)}", pw)
            kind = part.get("type")
            if kind != "text":
                raise bad_request(f"{pw}.type {kind!r} is not supported (only 'text' parts)", f"{pw}.type")
            if not isinstance(part.get("text"), str):
                raise bad_request(f"{pw}.text must be a string", f"{pw}.text")
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad_request(f"{where} must be a string or a list of content parts, not {_json_type(content)}", where)


def _json_type(x: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(x), type(x).__name__)


def _function_of(item: Any, w: str) -> dict:
    """The `function` object of a tool or tool call ({"type": "function", "function": {"name": ...}})."""
    if not isinstance(item, dict):
        raise bad_request(f"{w} must be an object", w)
    if item.get("type", "function") != "function":
        raise bad_request(f"{w}.type must be 'function'", f"{w}.type")
    fn = item.get("function")
    if not isinstance(fn, dict):
        raise bad_request(f"{w}.function must be an object", f"{w}.function")
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise bad_request(f"{w}.function.name must be a non-empty string", f"{w}.function.name")
    return fn


def _tool_calls(calls: Any, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise bad_request(f"{where} must be an array", where)
    out = []
    for j, call in enumerate(calls):
        cw = f"{where}[{j}]"
        fn = _function_of(call, cw)
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError as e:
                raise bad_request(f"{cw}.function.arguments is not valid JSON: {e}",
                                  f"{cw}.function.arguments") from None
            except RecursionError:
                args = None                 # deeper than json can parse: refused just below
        elif not isinstance(args, dict):
            raise bad_request(f"{cw}.function.arguments must be a JSON string", f"{cw}.function.arguments")
        if args is None or depth(args) > MAX_DEPTH:
            raise bad_request(f"{cw}.function.arguments is nested more than {MAX_DEPTH} levels deep",
                              f"{cw}.function.arguments")
        item = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if call.get("id") is not None:
            if not isinstance(call["id"], str):
                raise bad_request(f"{cw}.id must be a string", f"{cw}.id")
            item["id"] = call["id"]
        out.append(item)
    return out


def normalize_messages(messages: Any) -> list[dict]:
    """Validate OpenAI messages and turn them into what chat templates expect (string contents,
    tool call arguments as dicts)."""
    if not isinstance(messages, list):
        raise bad_request(f"messages must be an array, not {_json_type(messages)}", "messages")
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    out = []
    for i, m in enumerate(messages):
        w = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{w} must be an object, not {_json_type(m)}", w)
        role = m.get("role")
        if not isinstance(role, str):
            raise bad_request(f"{w}.role is required (one of {', '.join(ROLES)})", f"{w}.role")
        if role not in ROLES:
            raise bad_request(f"{w}.role {role!r} is not one of {', '.join(ROLES)}", f"{w}.role")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role}
        calls = m.get("tool_calls")
        has_calls = role == "assistant" and calls is not None
        msg["content"] = _text_content(m.get("content"), f"{w}.content", allow_null=role == "assistant")
        if has_calls:
            msg["tool_calls"] = _tool_calls(calls, f"{w}.tool_calls")
        elif calls is not None:
            raise bad_request(f"{w}.tool_calls is only allowed in assistant messages", f"{w}.tool_calls")
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise bad_request(f"{w}.{key} must be a string", f"{w}.{key}")
                msg[key] = m[key]
        out.append(msg)
    return out


def normalize_tools(tools: Any, tool_choice: Any) -> list[dict] | None:
    """The tools to give the template, or None (no tools, or tool_choice "none")."""
    if tools is None:
        if tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise bad_request(f"tools must be an array, not {_json_type(tools)}", "tools")
    names = []
    for i, t in enumerate(tools):
        w = f"tools[{i}]"
        fn = _function_of(t, w)
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad_request(f"{w}.function.parameters must be an object", f"{w}.function.parameters")
        names.append(fn["name"])
    if tool_choice is None or tool_choice in ("auto", "required"):
        pass
    elif tool_choice == "none":
        return None
    elif isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        if tool_choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request("tool_choice must be 'none', 'auto', 'required' or "
                              "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
        if fn["name"] not in names:
            raise bad_request(f"tool_choice names {fn['name']!r}, which is not in tools", "tool_choice")
    else:
        raise bad_request("tool_choice must be 'none', 'auto', 'required' or an object naming a function",
                          "tool_choice")
    return tools or None


# ------------------------------------------------------------------------------------------- sizes

def depth(x: Any) -> int:
    """Levels of objects/arrays in a JSON value (a scalar is 0), without recursion."""
    deepest, stack = 0, [(x, 0)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, dict):
            x = list(x.values())
        if isinstance(x, list):
            deepest = max(deepest, d + 1)
            stack.extend((v, d + 1) for v in x)
    return deepest


def n_chars(x: Any) -> int:
    """Characters of every string (object keys too) in a JSON value."""
    return sum(len(s) for s in json_strings(x))


def check_sizes(engine, messages: Any, tools: Any) -> None:
    """The bounds above, on the raw request fields, before any validation that walks them deeply."""
    if isinstance(messages, list) and len(messages) > MAX_MESSAGES:
        raise bad_request(f"messages has {len(messages)} items, at most {MAX_MESSAGES} are allowed", "messages")
    if isinstance(tools, list):
        if len(tools) > MAX_TOOLS:
            raise bad_request(f"tools has {len(tools)} items, at most {MAX_TOOLS} are allowed", "tools")
        for i, t in enumerate(tools):
            if depth(t) > MAX_DEPTH:
                raise bad_request(f"tools[{i}] is nested more than {MAX_DEPTH} levels deep", f"tools[{i}]")
    chars = n_chars(messages) + n_chars(tools)
    if chars > MAX_CHARS:
        raise bad_request(f"messages and tools hold {chars} characters, at most {MAX_CHARS} are allowed",
                          "messages")
    check_fits(engine, _content_chars(messages), "messages")


def _content_chars(messages: Any) -> int:
    """Characters of the message contents (string or text parts), which every template writes out."""
    total = 0
    for m in messages if isinstance(messages, list) else ():
        content = m.get("content") if isinstance(m, dict) else None
        parts = content if isinstance(content, list) else [content]
        for p in parts:
            text = p.get("text") if isinstance(p, dict) else p
            total += len(text) if isinstance(text, str) else 0
    return total


def check_fits(engine, chars: int, param: str) -> None:
    """400 context_length_exceeded when `chars` characters cannot fit in n_ctx tokens even at the most
    characters one token of the vocabulary stands for (a lower bound of the token count)."""
    n_ctx = int(getattr(engine, "n_ctx", 0) or 0)
    per_token = ControlTokens.of(engine.tokenizer).max_token_chars
    at_least = -(-chars // per_token)
    if n_ctx and at_least >= n_ctx:
        what = "the prompt holds" if param == "prompt" else f"the {param} hold"
        raise APIError(400, f"{what} {chars} characters, at least {at_least} tokens (a token of this model "
                       f"stands for at most {per_token} characters), more than the context (n_ctx = {n_ctx})",
                       param=param, code="context_length_exceeded",
                       extra={"n_prompt_tokens": at_least, "n_ctx": n_ctx})     # a lower bound here


# ------------------------------------------------------------------------------------------ prompt

def render_prompt(engine, messages: list[dict], tools: list[dict] | None) -> MarkedPrompt:
    """The template's rendering, with the control-token texts that came from the inputs marked."""
    template = getattr(engine, "chat_template", None)
    if template is None:
        raise bad_request("the model has no chat template; use /v1/completions", "messages")
    try:
        return template.render_marked(messages, ControlTokens.of(engine.tokenizer), tools=tools,
                                      add_generation_prompt=True)
    except Exception as e:
        if type(e).__name__ == "ChatTemplateError":
            raise APIError(400, str(e), param="messages", code="chat_template_error") from None
        raise


def prompt_ids(engine, prompt: MarkedPrompt) -> list[int]:
    """Tokens of a rendered chat prompt: control tokens where the template wrote them, plain text for
    the inputs; BOS is added as the model asks unless the template already wrote it."""
    bos = getattr(engine.chat_template, "bos_token", "") or ""
    add_special = not (bos and prompt.text.startswith(bos))
    return ControlTokens.of(engine.tokenizer).encode(engine.tokenizer, prompt, add_special=add_special)
