"""Chat template tests: the golden conversations (rendered by transformers 5.24.0 from the GGUF's
template, tokenized by llama.cpp) and Hugging Face template semantics."""

import json
import re
from datetime import datetime
from pathlib import Path

import pytest

from strata_lite.loader.chat_template import ChatTemplate, ChatTemplateError
from strata_lite.loader.gguf_file import read_metadata
from strata_lite.loader.tokenizer import Tokenizer

DATA = Path(__file__).resolve().parent.parent / "data"
CHAT = json.loads((DATA / "chat.json").read_text(encoding="utf-8"))["cases"]

_cache: dict = {}


@pytest.fixture
def qwen(default_model_path):
    path = str(default_model_path)
    if path not in _cache:
        meta = read_metadata(path)
        tok = Tokenizer.from_gguf_metadata(meta, Path(path).name)
        _cache[path] = (ChatTemplate.from_gguf_metadata(meta, tok, Path(path).name), tok)
    return _cache[path]


@pytest.mark.parametrize("case", CHAT, ids=[c["name"] for c in CHAT])
def test_chat_golden(qwen, case):
    template, tok = qwen
    text = template.render(case["messages"], tools=case["tools"],
                           add_generation_prompt=case["add_generation_prompt"])
    assert text == case["text"]
    assert case["hf_transformers_ids_agree"]
    assert tok.encode(text, add_special=False, parse_special=True) == case["ids"]


def test_no_generation_prompt(qwen):
    template, _ = qwen
    msgs = [{"role": "user", "content": "hi"}]
    with_prompt = template.render(msgs)
    without = template.render(msgs, add_generation_prompt=False)
    assert with_prompt == without + "<|im_start|>assistant\n"
    assert template.eos_token == "<|im_end|>" and template.bos_token == "<|endoftext|>"


def test_tojson_keeps_key_order_and_unicode():
    t = ChatTemplate("{{ x | tojson }}|{{ x | tojson(indent=2) }}")
    x = {"b": "é\u4e2d<&>", "a": [1, None, True]}
    assert t.render([], x=x) == (json.dumps(x, ensure_ascii=False) + "|"
                                 + json.dumps(x, ensure_ascii=False, indent=2))


def test_variables_and_globals():
    t = ChatTemplate("{{ bos_token }}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
                     "{{ m.role }}:{{ m.content }};{% endfor %}{{ tools | length }}"
                     "{% if add_generation_prompt %}>{% endif %}{{ eos_token }}{{ custom }}",
                     bos_token="<s>", eos_token="</s>")
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}]
    assert t.render(msgs, tools=[{}, {}], custom="!") == "<s>user:a;assistant:b;2></s>!"
    assert t.render(msgs, tools=[], add_generation_prompt=False) == "<s>user:a;assistant:b;0</s>"
    year = ChatTemplate("{{ strftime_now('%Y') }}").render([])
    assert year in {str(datetime.now().year), str(datetime.now().year - 1)}


def test_trim_and_lstrip_blocks():
    t = ChatTemplate("{% for m in messages %}\n    {% if true %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}")
    assert t.render([{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]) == "x\ny\n"


def test_generation_block():
    t = ChatTemplate("{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}")
    assert t.render([{"role": "assistant", "content": "ok"}]) == "[ok]"


def test_raise_exception():
    t = ChatTemplate("{% if messages[0].role != 'system' %}{{ raise_exception('first must be system') }}{% endif %}")
    with pytest.raises(ChatTemplateError, match="first must be system"):
        t.render([{"role": "user", "content": "x"}])
    assert t.render([{"role": "system", "content": "x"}]) == ""


def test_syntax_error():
    with pytest.raises(ChatTemplateError, match="syntax error at line 2"):
        ChatTemplate("ok\n{% if %}")
    with pytest.raises(ChatTemplateError, match="empty"):
        ChatTemplate("")


def test_render_errors_are_chat_template_errors():
    with pytest.raises(ChatTemplateError, match="no attribute 'foo'"):
        ChatTemplate("{{ messages[0].foo.bar }}").render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError):  # the sandbox forbids mutating the messages
        ChatTemplate("{{ messages.append(1) }}").render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ ''.__class__.__mro__ }}{{ x.__globals__ }}").render([], x=lambda: 0)


@pytest.mark.parametrize("messages, pattern", [
    ("hello", "list of dicts"),
    ([["user", "hi"]], r"messages\[0\] must be a dict"),
    ([{"content": "hi"}], r"messages\[0\] has no 'role'"),
    ([{"role": "user", "content": 5}], r"messages\[0\]\['content'\]"),
])
def test_bad_messages(messages, pattern):
    with pytest.raises(ChatTemplateError, match=pattern):
        ChatTemplate("{{ messages }}").render(messages)


def test_bad_tools():
    with pytest.raises(ChatTemplateError, match="tools"):
        ChatTemplate("x").render([], tools={"type": "function"})


def test_missing_template():
    with pytest.raises(ChatTemplateError, match=re.escape("f.gguf: tokenizer.chat_template is missing")):
        ChatTemplate.from_gguf_metadata({}, source="f.gguf")
