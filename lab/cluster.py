"""What the cluster lab tests and the launcher benchmark share: the env roots each launcher deploys from, a placeholder
model, and the deploy playbook cut after the cluster's cross-host check (no vLLM)."""

from __future__ import annotations

import os
from pathlib import Path

ENV_ROOT = os.environ.get("YRPD_TEST_ENV_ROOT", "/opt/yrpd/venvs")
MODEL = "/tmp/models/tiny"


#: the dscli launcher's env root: the data-system venv and etcd of ENV_ROOT (and its vLLM venv, which the deploy checks
#: before the cluster starts), nothing of the yr CLI
NO_YR_ROOT = "/opt/yrpd/lab-no-yr"


def env_root(launcher: str) -> str:
    if launcher == "yr":
        return ENV_ROOT
    root = Path(NO_YR_ROOT)
    root.mkdir(parents=True, exist_ok=True)
    for name in ("ds", "etcd", "vllm"):
        link = root / name
        if not link.is_symlink():
            link.symlink_to(Path(ENV_ROOT, name))
    assert not (root / "yr").exists()
    return str(root)


def cluster_playbook(tmp_dir: Path) -> Path:
    """The real deploy playbook cut after the cluster's cross-host KV check, without the instances' start that comes
    before the cluster's (no vLLM in these tests)."""
    import yaml

    from yrpd.assets import playbook_path

    book = yaml.safe_load(playbook_path("deploy").read_text())
    runs = [step["run"] for step in book["steps"]]
    book["steps"] = [s for s in book["steps"][: runs.index("cluster.check_kv") + 1] if s["run"] != "instances.start"]
    path = tmp_dir / "cluster-only.yaml"
    path.write_text(yaml.safe_dump(book))
    return path


def put_model(*hosts):
    for host in hosts:
        host.exec(f"mkdir -p {MODEL} && echo '{{}}' > {MODEL}/config.json")
