"""Golden files under tests/unit/golden/<group>/: compare, or rewrite with YRPD_UPDATE_GOLDEN=1 (then review the diff)."""

import os
from pathlib import Path

ROOT = Path(__file__).parent / "golden"


def check_golden(group: str, name: str, text: str) -> None:
    path = ROOT / group / name
    if os.environ.get("YRPD_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"missing golden {path}; run with YRPD_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{name} differs from its golden; run with YRPD_UPDATE_GOLDEN=1 and review"
