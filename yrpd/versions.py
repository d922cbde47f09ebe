"""Versions yrpd pins, in one place. Drift between these has bitten users (see docs/compatibility.md)."""

OPENYUANRONG = "9.9.9"  # the `yr` CLI and bundled etcd (registry wheel; complete wheels come from openYuanrong's site)
OPENYUANRONG_DATASYSTEM = "0.8.1"  # dscli, datasystem_worker, KVClient
PYTHON_TAG = "python3.11"  # both wheels are cp311 only

#: where environments live on hosts unless the spec's env_path says otherwise
DEFAULT_ENV_ROOT = "/opt/yrpd/venvs"


def shell_exports() -> str:
    """`eval "$(python -m yrpd.versions)"` in scripts that install outside yrpd (tests, CI)."""
    return f"export YR_VERSION={OPENYUANRONG} DS_VERSION={OPENYUANRONG_DATASYSTEM}"


if __name__ == "__main__":
    print(shell_exports())
