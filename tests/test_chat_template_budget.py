"""Rendering a model folder's chat template (untrusted Jinja) is bounded in wall-clock time as well as in executed
template lines: a hostile template is refused in one line naming the template's file, never left to run."""

import time

import pytest
from _chat_families import chat_config, chat_tokenizer

from llm2vec import chat_turn
from llm2vec.templates import resolve_template

SLOW_LINES = "{% for i in range(4000) %}{{ ('x' * (10000000 + i)) | replace('x', 'yy') | length }}{% endfor %}"
"""Few template lines, each slow (a 10 MB string rewritten; it depends on the loop variable, so Jinja cannot fold it
into a constant when it compiles the template): far under the line budget, far over the time budget."""


def test_a_template_whose_few_lines_take_long_is_refused_in_one_line_naming_its_file(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setattr(chat_turn, "RENDER_SECONDS", 0.2)
    folder = tmp_path / "chat-model"
    chat_tokenizer("qwen3", chat_template=SLOW_LINES).save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    start = time.perf_counter()
    with pytest.raises(ValueError) as refused:
        resolve_template(chat_config("qwen3", tokenizer, eos_token_id=tokenizer.eos_token_id), tokenizer)
    assert time.perf_counter() - start < 5
    message = str(refused.value)
    assert "\n" not in message and "rendering a user conversation ran past 0.2 s" in message, message
    assert f"(the template: {folder / 'chat_template.jinja'})" in message, message
    assert message.startswith(f"the chat template of {folder} gives no prompt template: ")


def test_a_published_template_renders_well_within_the_time_budget():
    tokenizer = chat_tokenizer("qwen3")
    start = time.perf_counter()
    chat_turn.render(tokenizer, [{"role": "user", "content": "hello"}])
    assert time.perf_counter() - start < chat_turn.RENDER_SECONDS / 10
