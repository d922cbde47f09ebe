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


def test_a_shipped_script_keeps_each_docstrings_first_line_and_all_its_code():
    """Host commands must fit one exec argument: docstrings travel as their first line, comment lines not at all;
    a docstring sharing its line with code stays as written."""
    from yrpd import assets

    text = ('"""The module.\n\nMore of it."""\nimport os\n\n\ndef f(x):\n    """Adds one.\n\n    At length.\n    """\n'
            '    # why\n    return x + 1\n\n\nclass C:\n    """One line."""\n\n'
            '    def g(self): """As written, with its code."""; return os.sep\n')
    shipped = assets._as_shipped(text, "t.py")
    space: dict = {}
    exec(compile(shipped, "t.py", "exec"), space)
    assert (space["f"](1), space["f"].__doc__, space["C"].__doc__) == (2, "Adds one.", "One line.")
    assert space["C"]().g() == "/" and space["C"].g.__doc__ == "As written, with its code."
    assert space["__doc__"] == "The module. (in full: yrpd's deploy_scripts/t.py)"
    assert not any(gone in shipped for gone in ("More of it", "At length", "# why"))
    assert shipped.count("\n") < text.count("\n")
