"""Fuzzing the chat-template renderer: random message lists (roles, content of every JSON type, nested
tool calls and tools) through the default model's real template (Qwen2.5's, read from its GGUF), the
tiny model's and the server fake engine's, plain and injection-safe (render_marked); and hostile
templates. Only str results or ChatTemplateError.

hypothesis rather than atheris (see test_fuzz_gguf.py's docstring), seeded (derandomize=True).
Templates come from the model file the operator chose, never from a request; the sandbox
(ImmutableSandboxedEnvironment) keeps them from touching Python internals, and deep recursion ends as
a ChatTemplateError. What a template's own loops and string growth cost is not bounded by the renderer:
`{% macro f(x) %}{{ f(x ~ x) }}{% endmacro %}{{ f('a') }}` doubles a string until memory runs out (a
MemoryError under a ulimit becomes a ChatTemplateError; without one the process grows), so a hostile
GGUF template is the operator's to refuse, like the rest of the file.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from strata_lite.loader.chat_template import ChatTemplate, ChatTemplateError
from strata_lite.loader.control_tokens import ControlTokens
from strata_lite.loader.gguf_file import read_metadata
from strata_lite.loader.tokenizer import Tokenizer
from tiny_model import CHAT_TEMPLATE

FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
CONTROL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>", "\ue000"]
TEXT = st.one_of(st.text(max_size=20), st.sampled_from(CONTROL),
                 st.lists(st.sampled_from(CONTROL + ["x", "\n", " "]), max_size=6).map("".join))
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TEXT,
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                    max_leaves=12)
ROLE = st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "developer"]), TEXT)
CALL = st.fixed_dictionaries({"type": st.just("function"),
                              "function": st.fixed_dictionaries({"name": TEXT, "arguments": JSON})})
MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": ROLE, "content": st.one_of(TEXT, st.none(), JSON)},
                          optional={"tool_calls": st.lists(CALL, max_size=2), "name": TEXT,
                                    "tool_call_id": TEXT, "reasoning_content": TEXT}),
    JSON)
TOOL = st.one_of(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": TEXT, "description": TEXT, "parameters": JSON})}), JSON)
MESSAGES = st.one_of(st.lists(MESSAGE, max_size=5), JSON)
TOOLS = st.one_of(st.none(), st.lists(TOOL, max_size=3), JSON)


@pytest.fixture(scope="module")
def qwen(default_model_path):
    meta = read_metadata(default_model_path)
    tok = Tokenizer.from_gguf_metadata(meta, "qwen")
    return ChatTemplate.from_gguf_metadata(meta, tok, "qwen"), tok


@pytest.fixture(scope="module", params=["qwen", "tiny"])
def template(request, qwen):
    return qwen[0] if request.param == "qwen" else ChatTemplate(CHAT_TEMPLATE, eos_token="<|im_end|>")


@FUZZ
@given(messages=MESSAGES, tools=TOOLS, add_generation_prompt=st.booleans())
def test_render(template, messages, tools, add_generation_prompt):
    try:
        text = template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt)
    except ChatTemplateError:
        return
    assert isinstance(text, str)


@FUZZ
@given(messages=MESSAGES, tools=TOOLS)
def test_render_marked_and_tokenize(qwen, messages, tools):
    """The injection-safe path the server takes, down to token ids."""
    template, tok = qwen
    controls = ControlTokens.of(tok)
    try:
        marked = template.render_marked(messages, controls, tools=tools)
    except ChatTemplateError:
        return
    ids = controls.encode(tok, marked)
    assert all(0 <= i < tok.n_vocab for i in ids)


@pytest.mark.parametrize("source", [
    "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",                       # unbounded recursion
    "{{ messages.__class__.__mro__[1].__subclasses__() }}",                  # sandbox escape
    "{{ range(10**9) | list | length }}",                                    # the sandbox caps range()
    "{{ raise_exception('no') }}",
    "{% for m in messages %}{{ m.content.upper().foo.bar }}{% endfor %}",
    "{% set x = 1 / 0 %}",
    "{{ messages | tojson(separators=1) }}",
])
def test_hostile_templates(source):
    with pytest.raises(ChatTemplateError):
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])


@FUZZ
@given(st.text(max_size=60))
def test_random_template_sources(source):
    """Any text either compiles and renders or gives a ChatTemplateError."""
    try:
        out = ChatTemplate(source).render([{"role": "user", "content": "hi"}])
    except ChatTemplateError:
        return
    assert isinstance(out, str)
