"""Options shared by subcommands (yrpd.spec turns them into a DeploySpec: `spec_from_flags`, `ssh_from_flags`)."""

from __future__ import annotations

from functools import wraps
from typing import Any, Callable

import click

from yrpd import __version__


def version(func: Callable) -> Callable:
    return click.version_option(__version__, "--version", prog_name="yrpd")(func)


def ssh_options(func: Callable) -> Callable:
    options = [
        click.option("--ssh-config", "ssh_config", metavar="FILE", help="ssh_config for host aliases [~/.ssh/config]"),
        click.option("-i", "--identity", metavar="FILE", help="private key for SSH"),
        click.option("--known-hosts", "known_hosts", metavar="FILE", help="known_hosts to verify host keys [~/.ssh/known_hosts]"),
        click.option("--accept-new-host-keys", "accept_new_host_keys", is_flag=True, default=None,
                     help="trust unknown host keys on first use and add them to known_hosts"),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def spec_options(func: Callable) -> Callable:
    """Every flag maps onto one spec field (yrpd.spec.spec_from_flags); flags win over the config file."""
    options = [
        click.option("--config", "config_file", metavar="FILE", help="YAML config [./yrpd.yaml if present]"),
        click.option("--hosts", metavar="LIST", help="h1,h2 or user@host:port or ssh_config aliases"),
        click.option("--master", metavar="HOST", help="host for the cluster master and proxy [first host]"),
        click.option("--devices", metavar="LIST", help="device ids on every host: 0-3 or 0,1,2,3 [all detected]"),
        click.option("--device-kind", type=click.Choice(["auto", "npu", "gpu", "cpu"]), help="[auto: detected]"),
        click.option("--runtime", type=click.Choice(["auto", "docker", "host"]),
                     help="containers or host processes [auto: docker on NPU hosts, host elsewhere]"),
        click.option("--image", metavar="IMAGE", help="container image (runtime docker)"),
        click.option("--container-profile", metavar="NAME|FILE",
                     help="container profile (runtime docker): a name in containers/ or a file [the one for --image]"),
        click.option("--prefill", type=int, metavar="N", help="prefill instances (PREFILL_INS_NUM) [1]"),
        click.option("--decode", type=int, metavar="N", help="decode instances (DECODE_INS_NUM) [1]"),
        click.option("--prefill-tensor-parallel-size", "--ptp", "ptp", type=int, metavar="N",
                     help="devices of each prefill instance's TP group [1]"),
        click.option("--decode-tensor-parallel-size", "--dtp", "dtp", type=int, metavar="N",
                     help="devices of each decode instance's TP group [1]"),
        click.option("--prefill-data-parallel-size", "--pdp", "pdp", type=int, metavar="N",
                     help="data parallel ranks of each prefill instance [1]"),
        click.option("--decode-data-parallel-size", "--ddp", "ddp", type=int, metavar="N",
                     help="data parallel ranks of each decode instance [1]"),
        click.option("--prefill-pipeline-parallel-size", "--ppp", "ppp", type=int, metavar="N",
                     help="pipeline stages of each prefill instance [1]"),
        click.option("--decode-pipeline-parallel-size", "--dpp", "dpp", type=int, metavar="N",
                     help="pipeline stages of each decode instance [1]"),
        click.option("--multi-node-backend", type=click.Choice(["auto", "ray", "mp"]),
                     help="how an instance spanning hosts runs: ray (vLLM's recipe) or mp (vLLM's --nnodes) "
                          "[auto: ray on NPU/GPU, mp on CPU]"),
        click.option("--model", metavar="PATH", help="model directory on the hosts"),
        click.option("--served-model-name", metavar="NAME", help="model name clients use [model dir name]"),
        click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
                     help="dtype of compute and KV [auto: CPU hosts their fastest, else the model's]"),
        click.option("--proxy-port", type=int, metavar="N", help="proxy port on the master [8000]"),
        click.option("--routing", type=click.Choice(["load", "prefix", "round-robin"]),
                     help="how the proxy picks an instance: prefix (cache-aware: where the prompt's unseen part plus "
                          "the work queued there is least), load (fewest requests in flight) or round-robin "
                          "[prefix]"),
        click.option("--kv-connector", type=click.Choice(["yuanrong", "ascend-store", "example", "lmcache", "nixl"]),
                     help="what moves KV: yrpd's connector, vllm-ascend's AscendStoreConnector, or a bench peer "
                          "[yuanrong]"),
        click.option("--cluster-launcher", type=click.Choice(["auto", "dscli", "yr"]),
                     help="what runs the data system: dscli (no yr CLI) or yr [auto: dscli unless full mode]"),
        click.option("--env", "env_pairs", multiple=True, metavar="KEY=VALUE", help="extra environment for services (repeatable)"),
        click.option("--env-path", metavar="DIR", help="use an environment already on the hosts; skip installs"),
    ]
    func = ssh_options(func)
    for option in reversed(options):
        func = option(func)
    return func


def session_option(func: Callable) -> Callable:
    return click.option("--session", "session_id", metavar="ID", help="session to act on [latest]")(func)


def passthrough(func: Callable) -> Callable:
    @wraps(func)
    def wrapper(**params: Any) -> Any:
        return func(params)

    return wrapper
