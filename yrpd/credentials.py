"""A deployment's secrets: made once per session on the controller, kept in files only their owner can read.

`<session>/secrets/` (mode 0700) on the controller holds `instance.token` (the token every vLLM instance requires
on its /v1 routes) and one environment file per kind of process (`instance.env`, `proxy.env`, mode 0600). The
deploy copies the environment files over SFTP into the host's `<session>/secrets/` (0700, yrpd.layout); each
process's supervisor reads its file when it starts the process. So a secret is never part of a command line (`ps`,
`yrpd plan`, the session journal, the logs) and `yrpd down` removes it from the hosts and from here.
"""

from __future__ import annotations

import os
import secrets as random_tokens
from pathlib import Path

#: vLLM's own variable: with it set, vLLM requires `Authorization: Bearer <token>` on /v1, /v2, /inference
VLLM_TOKEN_ENV = "VLLM_API_KEY"
#: the proxy's variables: the token it sends to the instances, and the key it requires from clients
PROXY_TOKEN_ENV = "YRPD_INSTANCE_TOKEN"
PROXY_KEY_ENV = "YRPD_API_KEY"
#: the environment files, by the kind of process that reads them
INSTANCE, PROXY = "instance", "proxy"
TOKEN_FILE = "instance.token"


def secrets_dir(session_path: Path) -> Path:
    return Path(session_path) / "secrets"


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` readable by its owner only, from the first byte on (then renamed into place)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def env_text(values: dict[str, str]) -> str:
    for key, value in values.items():
        if "\n" in value or "\r" in value:
            raise ValueError(f"{key}: a secret cannot span lines")
    return "".join(f"{key}={value}\n" for key, value in values.items())


def ensure(session_path: Path, proxy_key: str | None) -> Path:
    """Make the session's token (once) and its environment files (every deploy: the proxy key may have changed);
    returns the directory."""
    d = secrets_dir(session_path)
    d.mkdir(mode=0o700, exist_ok=True)
    os.chmod(d, 0o700)
    token_file = d / TOKEN_FILE
    if not token_file.exists():
        write_private(token_file, random_tokens.token_urlsafe(32) + "\n")
    token = token_file.read_text().strip()
    write_private(d / f"{INSTANCE}.env", env_text({VLLM_TOKEN_ENV: token}))
    proxy = {PROXY_TOKEN_ENV: token, **({PROXY_KEY_ENV: proxy_key} if proxy_key else {})}
    write_private(d / f"{PROXY}.env", env_text(proxy))
    return d


def instance_token(session_path: Path) -> str | None:
    """The token the session's instances require, where this controller deployed them (None for a session made
    before instances required one)."""
    try:
        return (secrets_dir(session_path) / TOKEN_FILE).read_text().strip() or None
    except FileNotFoundError:
        return None


def remove(session_path: Path) -> None:
    d = secrets_dir(session_path)
    if d.is_dir():
        for entry in d.iterdir():
            entry.unlink()
        d.rmdir()
