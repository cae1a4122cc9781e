"""Chat templates render under a budget (issue 18, item 5): CPU seconds and output characters, in a worker process
that is killed when over; the error names the budget and its limit, and no work survives the render."""

from __future__ import annotations

import os
import threading
import time

import pytest

from tracelm import TracelmError
from tracelm.io import chat_template
from tracelm.io.chat_template import RenderBudget, render_chat

MESSAGES = [{"role": "user", "content": "Hi"}]
FAST = RenderBudget(cpu_seconds=0.5, max_chars=100_000)


def over_budget(template: str, budget: RenderBudget = FAST) -> tuple[str, float]:
    """The error message of rendering `template`, and the seconds it took."""
    t0 = time.monotonic()
    with pytest.raises(TracelmError) as e:
        render_chat(template, MESSAGES, budget=budget)
    return str(e.value), time.monotonic() - t0


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_nested_loop_stops_at_the_cpu_budget_and_leaves_nothing_running():
    render_chat(None, MESSAGES)  # a worker exists
    workers, threads = chat_template._POOL.pids(), threading.active_count()
    message, seconds = over_budget("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    assert message == "chat template: rendering exceeded 0.5 s of CPU (template_cpu_seconds)"
    assert seconds < 5
    assert not any(pid_alive(pid) for pid in workers)  # the busy worker was killed, not left spinning
    assert threading.active_count() == threads  # and no thread of ours was left behind
    assert render_chat(None, MESSAGES).startswith("<|im_start|>user")  # the next render gets a new worker


def test_a_huge_string_is_refused_before_it_is_built():
    message, seconds = over_budget("{{ 'x' * 10**9 }}")
    assert message == "chat template: rendering output over 100000 characters (template_max_chars)"
    assert seconds < 5


def test_output_past_the_budget_is_cut_as_it_is_produced():
    message, _ = over_budget("{% for i in range(100000) %}{{ 'abcdefghij' }}{% endfor %}")
    assert "output over 100000 characters" in message


def test_a_huge_list_is_refused():
    message, seconds = over_budget("{{ range(10**7) | list | length }}")
    assert "Range too big" in message and seconds < 5
    message, _ = over_budget("{{ ([0] * 10**8) | length }}")
    assert "output over 100000 characters" in message


def test_doubling_a_string_meets_the_memory_limit():
    template = ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
                "{{ ns.s | length }}")
    message, seconds = over_budget(template, RenderBudget(cpu_seconds=20, max_chars=100_000))
    assert f"{chat_template.WORKER_MEMORY_MB} MB of memory" in message and seconds < 20


def test_recursion_through_macros_is_an_error_or_stops_at_the_budget():
    message, seconds = over_budget("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}")
    assert "RecursionError" in message and seconds < 5
    branching = "{% macro f(n) %}{% if n < 40 %}{{ f(n + 1) }}{{ f(n + 1) }}{% endif %}{% endmacro %}{{ f(0) }}"
    message, seconds = over_budget(branching)
    assert "exceeded 0.5 s of CPU" in message and seconds < 5


def test_normal_templates_render_as_before_through_the_worker():
    assert render_chat(None, MESSAGES) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    odd = [{"role": "user", "content": "lone \ud800 surrogate and 🦙"}]
    expected = "<|im_start|>user\nlone \ud800 surrogate and 🦙<|im_end|>\n"
    assert render_chat(None, odd, add_generation_prompt=False) == expected
    with pytest.raises(TracelmError, match="syntax error at line 2"):
        render_chat("ok\n{% for m in messages %}", MESSAGES)


def test_concurrent_renders_each_get_their_answer():
    results: dict[int, str] = {}

    def render(i: int) -> None:
        results[i] = render_chat("{{ messages[0]['content'] }}", [{"role": "user", "content": str(i)}])

    threads = [threading.Thread(target=render, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {i: str(i) for i in range(12)}
    assert len(chat_template._POOL.pids()) <= chat_template._POOL_SIZE


def test_the_budget_comes_from_the_run_config():
    from tracelm.session import run_config, template_budget

    cfg = run_config(None, None, ["template_cpu_seconds=0.25", "template_max_chars=5000"])
    assert template_budget(cfg) == RenderBudget(0.25, 5000)
    with pytest.raises(TracelmError, match="template_cpu_seconds"):
        run_config(None, None, ["template_cpu_seconds=0"])
