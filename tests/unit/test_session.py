"""yrpd/session.py: the local session directories (spec, plan, state, journal) and how a session is found again."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from yrpd.errors import SessionError
from yrpd.session import SESSION_ID_RE, Session, SessionPhase, SessionStore, new_session_id, resolve_root


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    return text


# -- create / latest / get -----------------------------------------------------------------------------

def test_create_makes_a_session_directory_and_points_latest_at_the_newest(tmp_path: Path):
    store = SessionStore(tmp_path / "sessions")  # made on first use
    first = store.create()
    assert first.path.parent == tmp_path / "sessions" and first.path.is_dir()
    assert SESSION_ID_RE.match(first.id)
    assert os.readlink(tmp_path / "sessions" / "latest") == first.id  # relative: the root can be moved
    second = store.create()
    assert second.id != first.id
    assert store.latest() == second
    assert store.get(None) == second and store.get("latest") == second
    assert store.get(first.id) == first  # an older session by its id
    assert not list((tmp_path / "sessions").glob(".latest*"))  # no temporary link left behind


def test_no_session_yet_says_to_deploy_first(tmp_path: Path):
    store = SessionStore(tmp_path / "sessions")
    assert store.latest() is None
    with pytest.raises(SessionError) as exc:
        store.get(None)
    text = one_line(exc)
    assert str(tmp_path / "sessions") in text and "run yrpd deploy first" in text and "--session" in text


def test_latest_pointing_at_a_removed_session_is_no_session(tmp_path: Path):
    store = SessionStore(tmp_path)
    session = store.create()
    session.path.rmdir()  # the user removed the directory by hand
    assert store.latest() is None
    with pytest.raises(SessionError, match="run yrpd deploy first"):
        store.get("latest")


@pytest.mark.parametrize("bad", ["20261122", "../etc", "20261122-133000-A1B2C3", "20261122-133000-a1b2c3/x", ""])
def test_a_malformed_session_id_is_refused_with_the_expected_form(tmp_path: Path, bad: str):
    with pytest.raises(SessionError) as exc:
        SessionStore(tmp_path).get(bad)
    text = one_line(exc)
    assert text.startswith(f"--session: {bad!r} is not a session id")
    assert "like 20261122-133000-a1b2c3" in text and f"ls {tmp_path}" in text


def test_an_unknown_session_id_names_where_it_was_looked_for(tmp_path: Path):
    SessionStore(tmp_path).create()
    with pytest.raises(SessionError) as exc:
        SessionStore(tmp_path).get("20200101-000000-abcdef")
    assert one_line(exc) == f"--session: no session 20200101-000000-abcdef under {tmp_path}"


def test_a_session_without_its_spec_says_it_is_incomplete_and_how_to_clear_it(tmp_path: Path):
    session = SessionStore(tmp_path).create()
    assert session.plan_data is None
    with pytest.raises(SessionError) as exc:
        session.spec_data
    assert one_line(exc) == f"session {session.id} has no spec.json: it is incomplete; remove {session.path}"
    session.write_spec({"hosts": ["h1"]})
    session.write_plan({"instances": []})
    assert Session(session.path).spec_data == {"hosts": ["h1"]} and session.plan_data == {"instances": []}
    assert sorted(p.name for p in session.path.iterdir()) == ["plan.json", "spec.json"]  # no temporary files left


def test_new_session_ids_are_the_local_time_and_sort_by_it():
    import time

    stamp = time.mktime((2026, 11, 22, 13, 30, 0, 0, 0, -1))
    sid = new_session_id(stamp)
    assert sid.startswith("20261122-133000-") and SESSION_ID_RE.match(sid)
    assert new_session_id(stamp - 1) < sid < new_session_id(stamp + 60)


def test_all_lists_sessions_oldest_first_and_nothing_else(tmp_path: Path):
    assert SessionStore(tmp_path / "none").all() == []  # no root yet: no sessions, no error
    store = SessionStore(tmp_path)
    for sid in ("20260102-000000-000000", "20251231-235959-ffffff", "20260101-120000-abcdef"):
        (tmp_path / sid).mkdir()
    store.create()  # today's, and the latest link
    (tmp_path / "notes").mkdir()
    (tmp_path / "20260103-000000-aaaaaa").write_text("a file, not a session")
    ids = [s.id for s in store.all()]
    assert ids[:3] == ["20251231-235959-ffffff", "20260101-120000-abcdef", "20260102-000000-000000"]
    assert ids[3] == store.latest().id and len(ids) == 4


# -- state.json: the phase ------------------------------------------------------------------------------

def test_a_new_session_is_new_until_a_phase_is_written(tmp_path: Path):
    session = SessionStore(tmp_path).create()
    assert session.phase is SessionPhase.new and not (session.path / "state.json").exists()


@pytest.mark.parametrize("phase", list(SessionPhase))
def test_every_phase_round_trips_through_state_json_as_its_value(tmp_path: Path, phase: SessionPhase):
    session = SessionStore(tmp_path).create()
    session.set_state(phase)
    written = json.loads((session.path / "state.json").read_text())
    assert written["phase"] == phase.value and written["updated"]
    assert Session(session.path).phase is phase  # read back by another process
    session.set_state(phase.value)  # the string form is accepted as well
    assert Session(session.path).phase is phase


def test_set_state_keeps_the_other_fields_and_none_clears_one(tmp_path: Path):
    session = SessionStore(tmp_path).create()
    session.set_state("deploying", playbook="deploy")
    session.set_state(SessionPhase.failed, failed_step="start the proxy on the master")
    assert session.state["playbook"] == "deploy" and session.state["failed_step"] == "start the proxy on the master"
    session.set_state(purged=True)  # no phase: the phase stays
    assert session.phase is SessionPhase.failed and session.state["purged"] is True
    session.set_state(SessionPhase.deployed, failed_step=None)
    assert session.phase is SessionPhase.deployed and session.state["failed_step"] is None
    assert session.state["playbook"] == "deploy"


def test_an_unknown_phase_is_refused_before_anything_is_written(tmp_path: Path):
    session = SessionStore(tmp_path).create()
    session.set_state(SessionPhase.deployed)
    with pytest.raises(ValueError, match="'finished'"):
        session.set_state("finished")
    assert session.phase is SessionPhase.deployed


def test_a_hand_edited_unknown_phase_is_named_when_read(tmp_path: Path):
    session = SessionStore(tmp_path).create()
    (session.path / "state.json").write_text(json.dumps({"phase": "running"}))
    with pytest.raises((ValueError, SessionError), match="'running'"):
        session.phase


def test_written_phases_are_the_values_docs_and_scripts_read():
    """state.json is read by people and scripts: these spellings are the interface."""
    assert [p.value for p in SessionPhase] == ["new", "deploying", "deployed", "failed", "down", "down-failed"]
    assert str(SessionPhase.down_failed) == "down-failed" and f"{SessionPhase.failed}" == "failed"


def test_which_phases_resume_and_which_hold_something_on_the_hosts():
    assert {p for p in SessionPhase if p.resumable} == {SessionPhase.failed, SessionPhase.deploying}
    # down-failed: teardown could not prove everything gone, so the session still counts as up
    assert {p for p in SessionPhase if not p.up} == {SessionPhase.new, SessionPhase.down}


# -- the journal ----------------------------------------------------------------------------------------

def test_journal_entries_come_back_in_order_with_their_time(tmp_path: Path):
    session = SessionStore(tmp_path).create()
    assert session.journal_entries() == []
    session.journal(step="create the session directory", host="h1", outcome="done", exit_code=0)
    session.journal(step="create the session directory", host="h2", outcome="failed", error="mkdir: denied")
    session.journal(step="start", host="h1", outcome="skipped", time="2026-01-01T00:00:00")
    entries = Session(session.path).journal_entries()
    assert [(e["host"], e["outcome"]) for e in entries] == [("h1", "done"), ("h2", "failed"), ("h1", "skipped")]
    assert entries[1]["error"] == "mkdir: denied"
    assert entries[0]["time"] and entries[2]["time"] == "2026-01-01T00:00:00"  # a given time is kept
    with open(session.path / "journal.jsonl", "a") as fh:
        fh.write("\n")  # a blank line (an editor's) is no entry
    assert len(session.journal_entries()) == 3


# -- where the sessions are -------------------------------------------------------------------------------

def test_resolve_root_is_yrpd_home_unless_the_spec_names_another(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("YRPD_HOME", raising=False)
    assert resolve_root(None) == tmp_path / "home" / ".yrpd" / "sessions"
    monkeypatch.setenv("YRPD_HOME", str(tmp_path / "yrpd"))
    assert resolve_root(None) == tmp_path / "yrpd" / "sessions"
    # the spec's default spelled out still means $YRPD_HOME
    assert resolve_root("~/.yrpd/sessions") == tmp_path / "yrpd" / "sessions"
    assert resolve_root(str(tmp_path / "elsewhere")) == tmp_path / "elsewhere"
    assert resolve_root("~/mine") == tmp_path / "home" / "mine"
