"""pytest fixtures for the fake-host lab (import them from a conftest.py)."""

from __future__ import annotations

import os
import shutil

import pytest

from lab.fakehosts import SSHD, FakeHostLab, cleanup_stale
from tests.prereq import missing

__all__ = ["fake_lab"]

_TOOLS = ("ip", "unshare", "nsenter", "ssh-keygen")


def _lab_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "fake-host lab needs root"
    missing = [t for t in _TOOLS if shutil.which(t) is None]
    if not os.access(SSHD, os.X_OK):
        missing.append(SSHD)
    return f"fake-host lab needs {', '.join(missing)}" if missing else None


@pytest.fixture
def fake_lab(tmp_path):
    """Factory: ``make(n, prefix=None, **options)`` starts and returns a FakeHostLab of n hosts
    (options: fake_npus, overlays, docker; see lab/fakehosts.py).

    Every lab made is closed at teardown, whether the test passed or not.
    """
    reason = _lab_unavailable()
    if reason:
        missing(f"{reason} (scripts/bootstrap.sh installs what the lab tests need)")
    cleanup_stale()
    labs: list[FakeHostLab] = []

    def make(n: int, prefix: str | None = None, **options) -> FakeHostLab:
        lab = FakeHostLab(n, tmp_path / f"lab{len(labs)}", prefix=prefix, **options)
        labs.append(lab)
        return lab.start()

    yield make

    errors = []
    for lab in labs:
        try:
            lab.close()
        except Exception as exc:  # close the others anyway
            errors.append(exc)
    if errors:
        raise errors[0]
