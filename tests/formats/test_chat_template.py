"""The rendering processes of formats/chat_template.py: kept for the next rendering, each rendering under its own
CPU limit, replaced after a failure, one per concurrent caller."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from moestream.errors import MoestreamError
from moestream.formats import chat_template

HELLO = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
MESSAGES = [{"role": "user", "content": "hello"}]


def idle_pids() -> set[int]:
    return {w.pid for w in chat_template._idle}


def test_a_process_renders_again_and_again():
    assert chat_template.render(HELLO, {"messages": MESSAGES}) == "user: hello\n"
    pids = idle_pids()
    for i in range(5):
        assert chat_template.render(HELLO, {"messages": [{"role": "user", "content": str(i)}]}) == f"user: {i}\n"
    assert idle_pids() == pids  # no process started


def test_each_rendering_gets_the_whole_cpu_limit():
    """Renderings that each take a good part of the limit, one after another in one process: none is stopped for
    the CPU the earlier ones used."""
    slow = "{% for a in range(n) %}{% for b in range(10000) %}{% endfor %}{% endfor %}done"  # sandbox: ranges <= 1e5
    n, start = 1, time.process_time()
    while True:  # a loop count taking ~0.4 s of this machine's CPU in-process (the child is no faster)
        t = time.perf_counter()
        chat_template.render(slow, {"n": n})
        took = time.perf_counter() - t
        if took > 0.4 or n >= 100000:
            break
        n *= 2
    assert time.process_time() - start < 1  # rendered in the child, not here
    for _ in range(int(2.5 * chat_template.CPU_SECONDS / took) + 1):  # more CPU in all than one rendering's limit
        assert chat_template.render(slow, {"n": n}) == "done"


def test_a_stopped_rendering_leaves_the_next_one_a_fresh_process():
    chat_template.render(HELLO, {"messages": MESSAGES})
    before = set(chat_template._idle)
    loop = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
    with pytest.raises(MoestreamError, match="rendering was stopped"):
        chat_template.render(loop, {})
    assert all(w.poll() is not None for w in before - set(chat_template._idle))  # the one that ran it is gone
    assert chat_template.render(HELLO, {"messages": MESSAGES}) == "user: hello\n"


def test_a_refusing_template_is_one_error_and_the_next_rendering_works():
    refuse = "{{ raise_exception('no system turn') }}"
    with pytest.raises(MoestreamError, match="no system turn"):
        chat_template.render(refuse, {})
    assert chat_template.render(HELLO, {"messages": MESSAGES}) == "user: hello\n"


def test_concurrent_callers_each_get_their_own_answer():
    with ThreadPoolExecutor(6) as pool:
        texts = list(
            pool.map(lambda i: chat_template.render(HELLO, {"messages": [{"role": "u", "content": i}]}), range(24))
        )
    assert texts == [f"u: {i}\n" for i in range(24)]
    assert len(chat_template._idle) <= chat_template.KEEP
