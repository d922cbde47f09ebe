"""The `yrpd bench` peers whose connector runs from a venv of its own beside vLLM's: their packages would change
the vLLM venv (LMCache pins older numpy, protobuf and grpcio; NIXL's are CUDA builds), so each gets
<env_root>/<name>, which sees the vLLM venv (deploy_scripts/install_beside_vllm.sh). The instances of such a
deployment run vLLM from that venv's Python."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from yrpd.layout import HostPaths
from yrpd.spec import KvConnector
from yrpd.versions import LMCACHE, NIXL


@dataclass(frozen=True)
class PeerVenv:
    name: str  # the venv is <env_root>/<name>
    requirements: tuple[str, ...]
    no_deps: bool  # install the requirements alone: their dependencies are the vLLM venv's
    probe: str  # Python that exits 0 once the peer is installed and imports beside vLLM


PEER_VENVS = {
    KvConnector.lmcache: PeerVenv("lmcache", (f"lmcache=={LMCACHE}",), False, "\n".join([
        "import os, sys",
        "os.environ['LMCACHE_TRACK_USAGE'] = 'false'",
        "from importlib import metadata",
        f"assert metadata.version('lmcache') == {LMCACHE!r}",
        "assert os.path.exists(os.path.join(os.path.dirname(sys.executable), 'lmcache'))",  # its server's command
        "import vllm",
        "from vllm.distributed.kv_transfer.kv_connector.v1 import lmcache_mp_connector",
        "from lmcache.v1.multiprocess import http_server",
    ])),
    KvConnector.nixl: PeerVenv("nixl", (f"nixl=={NIXL}", f"nixl-cu12=={NIXL}"), True, "\n".join([
        "from importlib import metadata",
        f"assert metadata.version('nixl-cu12') == {NIXL!r}",
        "from vllm.distributed.nixl_utils import NixlWrapper",  # vLLM's choice of the installed agent
        "assert NixlWrapper is not None",
    ])),
}


def install_args(peer: PeerVenv, vllm_venv: str, venv: str, wheels: str | None = None) -> str:
    """deploy_scripts/install_beside_vllm.sh's arguments for the peer, as shell words."""
    q = shlex.quote
    return " ".join([*(["--wheels", q(wheels)] if wheels else []), *(["--no-deps"] if peer.no_deps else []),
                     q(vllm_venv), q(venv), q(peer.probe), *map(q, peer.requirements)])


def main(argv: list[str] | None = None) -> int:
    """`python -m yrpd.peers NAME ENV_ROOT`: the installer's arguments for peer NAME under ENV_ROOT, as the deploy
    step gives them; scripts/test.sh prepares a machine with it up front."""
    import sys

    name, env_root = (argv if argv is not None else sys.argv[1:])[:2]
    peer = PEER_VENVS[KvConnector(name)]
    p = HostPaths(env_root=env_root, session=None, bundle_dir="")
    print(install_args(peer, p.vllm_venv, p.peer_venv(peer.name)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
