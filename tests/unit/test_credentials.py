"""yrpd/credentials.py: a session's secrets on the controller."""

import stat

import pytest

from yrpd import credentials


def mode(path):
    return stat.S_IMODE(path.stat().st_mode)


def test_secrets_are_private_made_once_and_removed(tmp_path):
    d = credentials.ensure(tmp_path, proxy_key="client-key")
    token = credentials.instance_token(tmp_path)
    assert mode(d) == 0o700 and len(token) >= 40
    assert {p.name: mode(p) for p in d.iterdir()} == {"instance.token": 0o600, "instance.env": 0o600,
                                                     "proxy.env": 0o600}
    assert (d / "instance.env").read_text() == f"VLLM_API_KEY={token}\n"
    assert (d / "proxy.env").read_text() == f"YRPD_INSTANCE_TOKEN={token}\nYRPD_API_KEY=client-key\n"
    # a re-deploy (resume) keeps the token the running instances hold, and takes a changed proxy key
    credentials.ensure(tmp_path, proxy_key=None)
    assert credentials.instance_token(tmp_path) == token
    assert (d / "proxy.env").read_text() == f"YRPD_INSTANCE_TOKEN={token}\n"
    (tmp_path / "other").mkdir()
    assert credentials.ensure(tmp_path / "other", None) and credentials.instance_token(tmp_path / "other") != token
    credentials.remove(tmp_path)
    assert not d.exists() and credentials.instance_token(tmp_path) is None


def test_a_key_spanning_lines_is_refused_rather_than_cut(tmp_path):
    with pytest.raises(ValueError, match="YRPD_API_KEY: a secret cannot span lines"):
        credentials.ensure(tmp_path, proxy_key="a\nVLLM_API_KEY=mine")
