"""Local session directories: one per deployment, holding its spec, plan, state and step journal.

Layout: `<root>/<YYYYmmdd-HHMMSS>-<6 hex>/{spec.json, plan.json, state.json, journal.jsonl}` and
`<root>/latest` -> the newest session. The root is `$YRPD_HOME/sessions` (default `~/.yrpd/sessions`)
unless the spec's `session_root` says otherwise. On each host the session lives under
`<remote_session_root>/<id>/`, laid out as yrpd.layout says.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from yrpd import credentials
from yrpd.errors import SessionError

SESSION_ID_RE = re.compile(r"^\d{8}-\d{6}-[0-9a-f]{6}$")


class SessionPhase(str, Enum):
    """Where a session's deployment stands, as recorded in its state.json (the values are what is written)."""

    new = "new"  # created, nothing run yet
    deploying = "deploying"
    deployed = "deployed"
    failed = "failed"  # a deploy step failed: `yrpd deploy` resumes it
    down = "down"
    down_failed = "down-failed"  # teardown could not prove everything gone: `yrpd down` again

    def __str__(self) -> str:
        return self.value

    @property
    def resumable(self) -> bool:
        return self in (SessionPhase.failed, SessionPhase.deploying)

    @property
    def up(self) -> bool:
        """Something of the session may run on the hosts."""
        return self not in (SessionPhase.new, SessionPhase.down)


def yrpd_home() -> Path:
    """yrpd's own directory where it runs: $YRPD_HOME, else ~/.yrpd (sessions, the wheel cache)."""
    home = os.environ.get("YRPD_HOME")
    return Path(home) if home else Path("~/.yrpd").expanduser()


def default_root() -> Path:
    return yrpd_home() / "sessions"


def resolve_root(session_root: str | None) -> Path:
    if session_root and session_root != "~/.yrpd/sessions":
        return Path(session_root).expanduser()
    return default_root()


def new_session_id(now: float | None = None) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return f"{stamp}-{secrets.token_hex(3)}"


@dataclass
class Session:
    path: Path

    @property
    def id(self) -> str:
        return self.path.name

    # -- files -------------------------------------------------------------------------------
    def _read_json(self, name: str, default: Any = None) -> Any:
        file = self.path / name
        if not file.is_file():
            return default
        return json.loads(file.read_text())

    def _write_json(self, name: str, data: Any) -> None:
        tmp = self.path / f".{name}.tmp"
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        tmp.replace(self.path / name)

    @property
    def token_file(self) -> Path:
        """Where this machine keeps the token a plain instance (no proxy) wants from its callers."""
        return credentials.secrets_dir(self.path) / credentials.TOKEN_FILE

    @property
    def spec_data(self) -> dict:
        data = self._read_json("spec.json")
        if data is None:
            raise SessionError(f"session {self.id} has no spec.json: it is incomplete; remove {self.path}")
        return data

    def write_spec(self, data: dict) -> None:
        self._write_json("spec.json", data)

    @property
    def bench_origin(self) -> dict | None:
        """Where `yrpd bench run` deployed this session for one of its targets: {"target", "spec": the spec that run
        varied, "deployed": the fingerprint of the target's spec}; None where it was deployed as the user asked."""
        return self._read_json("bench-origin.json")

    def write_bench_origin(self, origin: dict) -> None:
        self._write_json("bench-origin.json", origin)

    @property
    def plan_data(self) -> dict | None:
        return self._read_json("plan.json")

    def write_plan(self, data: dict) -> None:
        self._write_json("plan.json", data)

    @property
    def state(self) -> dict:
        return self._read_json("state.json", {"phase": SessionPhase.new.value})

    def set_state(self, phase: SessionPhase | None = None, **fields: Any) -> None:
        state = self.state
        if phase is not None:
            fields["phase"] = SessionPhase(phase).value
        state.update(fields, updated=time.strftime("%Y-%m-%dT%H:%M:%S"))
        self._write_json("state.json", state)

    @property
    def phase(self) -> SessionPhase:
        value = self.state.get("phase", SessionPhase.new.value)
        try:
            return SessionPhase(value)
        except ValueError:
            raise SessionError(f"session {self.id}: state.json says phase {value!r}, which is none of "
                               f"{', '.join(p.value for p in SessionPhase)}; fix {self.path / 'state.json'}") from None

    def journal(self, **entry: Any) -> None:
        entry.setdefault("time", time.strftime("%Y-%m-%dT%H:%M:%S"))
        with open(self.path / "journal.jsonl", "a") as fh:
            fh.write(json.dumps(entry, sort_keys=True) + "\n")

    def journal_entries(self) -> list[dict]:
        file = self.path / "journal.jsonl"
        if not file.is_file():
            return []
        return [json.loads(line) for line in file.read_text().splitlines() if line.strip()]


class SessionStore:
    def __init__(self, root: Path):
        self.root = root

    def create(self) -> Session:
        self.root.mkdir(parents=True, exist_ok=True)
        while True:
            path = self.root / new_session_id()
            try:
                path.mkdir()
                break
            except FileExistsError:
                continue
        latest = self.root / "latest"
        tmp = self.root / f".latest.{os.getpid()}"
        if tmp.is_symlink():
            tmp.unlink()
        tmp.symlink_to(path.name)
        tmp.replace(latest)
        return Session(path)

    def latest(self) -> Session | None:
        link = self.root / "latest"
        if not link.is_symlink():
            return None
        target = self.root / os.readlink(link)
        return Session(target) if target.is_dir() else None

    def get(self, session_id: str | None) -> Session:
        """The named session, or the latest one; a clear SessionError otherwise."""
        if session_id is None or session_id == "latest":
            session = self.latest()
            if session is None:
                raise SessionError(f"no deployment found under {self.root}; run yrpd deploy first (or pass --session ID)")
            return session
        if not SESSION_ID_RE.match(session_id):
            raise SessionError(f"--session: {session_id!r} is not a session id (like 20261122-133000-a1b2c3); see ls {self.root}")
        path = self.root / session_id
        if not path.is_dir():
            raise SessionError(f"--session: no session {session_id} under {self.root}")
        return Session(path)

    def all(self) -> list[Session]:
        if not self.root.is_dir():
            return []
        return sorted((Session(p) for p in self.root.iterdir() if SESSION_ID_RE.match(p.name) and p.is_dir()),
                      key=lambda s: s.id)
