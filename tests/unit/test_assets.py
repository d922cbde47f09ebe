"""yrpd/assets.py: the host scripts as they travel."""

from __future__ import annotations

from yrpd.assets import deploy_script


def test_the_hosts_scripts_are_never_parsed_by_two_threads_at_once(monkeypatch):
    """The steps build every host's command in a thread of its own, and CPython 3.11's parser can fail two parses at
    once ("AST constructor recursion depth mismatch", seen in a CI's containers deploy). A parse that takes its time
    shows whether another began meanwhile. The control: the same parse called without yrpd's lock overlaps."""
    import ast
    import threading
    import time

    from yrpd import assets

    real, state = ast.parse, {"now": 0, "most": 0}
    guard = threading.Lock()

    def slow(text, *a, **k):
        with guard:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
        time.sleep(0.02)
        try:
            return real(text, *a, **k)
        finally:
            with guard:
                state["now"] -= 1

    monkeypatch.setattr(ast, "parse", slow)

    def at_once(call) -> int:
        state["most"] = 0
        assets._as_shipped.cache_clear()
        threads = [threading.Thread(target=call) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return state["most"]

    assert at_once(lambda: deploy_script("supervise.py")) == 1
    assert at_once(lambda: ast.parse("x = 1")) > 1
