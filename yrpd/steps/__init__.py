"""Deploy and teardown steps. Each step is a pair of pure functions of (context, host):

- `run(ctx, host, **args) -> Command | NotNeeded` builds the shell script that does the work on that host;
- an optional check `(ctx, host, **args) -> Command | NotNeeded` whose exit status 0 means "already done, skip".

`NotNeeded(reason)` says the step has nothing to do on that host (a container step under the host runtime);
the host is skipped without a round trip and deploy's progress and `yrpd plan` show the reason.

Playbooks (playbooks/*.yaml) name them as `module.function` relative to this package. Nothing here
touches a host: yrpd.playbook runs the commands through yrpd.hostgroup, and `yrpd plan` prints them.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import shlex
from dataclasses import dataclass, field
from typing import Any, Callable

from yrpd.assets import deploy_script
from yrpd.hostgroup import Command
from yrpd.layout import HostSessionLayout
from yrpd.placement import HostPlan, Plan
from yrpd.spec import DeploySpec

SESSION_PLACEHOLDER = "SESSION_ID"


@dataclass
class StepContext:
    spec: DeploySpec
    plan: Plan
    session_id: str = SESSION_PLACEHOLDER
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def layout(self) -> HostSessionLayout:
        return HostSessionLayout(self.spec.remote_session_root, self.session_id)

    @property
    def host_session_dir(self) -> str:
        return self.layout.dir

    @property
    def spec_hash(self) -> str:
        return spec_fingerprint(self.spec)

    def host_spec(self, host: HostPlan):
        return self.spec.host(host.name)


def spec_fingerprint(spec: DeploySpec) -> str:
    """Identity of a deployment: everything in the spec but how we reach the hosts (ssh settings may change)."""
    data = spec.model_dump(mode="json", exclude={"ssh"})
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class NotNeeded:
    """A step or check's answer for a host where the step has nothing to do, and why."""

    reason: str

    def __str__(self) -> str:
        return f"not needed: {self.reason}"


StepFunction = Callable[..., "Command | NotNeeded"]


def resolve(ref: str) -> StepFunction:
    """`preflight.check_hosts` -> yrpd.steps.preflight.check_hosts (a dotted path outside this package works too)."""
    module_name, _, func_name = ref.rpartition(".")
    if not module_name:
        raise ValueError(f"step reference {ref!r} must look like module.function")
    try:
        module = importlib.import_module(f"yrpd.steps.{module_name}")
    except ModuleNotFoundError:
        module = importlib.import_module(module_name)
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ValueError(f"step reference {ref!r}: {module.__name__} has no function {func_name}")
    return func


def host_python(script_name: str, args: dict, timeout: float = 120, python: str = "python3") -> Command:
    """Run one of deploy_scripts/*.py with the host's python3 (or `python`), the script inlined as a here-document.

    The script travels inside the command (no stdin, no copy step), so it works the same over SSH and locally.
    """
    body = deploy_script(script_name)
    assert "YRPD_SCRIPT_END" not in body
    arg = shlex.quote(json.dumps(args, sort_keys=True))
    py = shlex.quote(python)
    script = (
        f"# deploy_scripts/{script_name}\n"  # names the script in a composed command (and for yrpd.testing)
        f'command -v {py} >/dev/null 2>&1 || {{ echo "{python} not found (PATH $PATH); install python3 (3.8+)" >&2; '
        "exit 127; }\n"
        f"{py} - {arg} <<'YRPD_SCRIPT_END'\n{body}\nYRPD_SCRIPT_END\n"
        # keep the script's status even when a caller appends commands after it
        "status=$?; [ $status -eq 0 ] || exit $status\n"
    )
    return Command(script=script, display=f"{python} deploy_scripts/{script_name} {arg}", timeout=timeout)


def shell_command(script: str, timeout: float = 120, display: str | None = None) -> Command:
    return Command(script=script, display=display, timeout=timeout)


def recording_pass(ctx: StepContext, check: Command, marker: str) -> Command:
    """The host check, then (only if it passed) this spec's hash written to the session file `marker`; on the
    host itself, also under the docker runtime."""
    path = shlex.quote(f"{ctx.host_session_dir}/{marker}")
    record = f"mkdir -p {shlex.quote(ctx.host_session_dir)} && echo {shlex.quote(ctx.spec_hash)} > {path}"
    return Command(script=f"{check.script}\n{record}", display=check.display, timeout=check.timeout, on_host=True)


def passed_before_with_this_spec(ctx: StepContext, marker: str) -> Command:
    """Exit 0 when the session file `marker` holds this spec's hash: the check passed earlier for the same spec."""
    path = shlex.quote(f"{ctx.host_session_dir}/{marker}")
    return Command(script=f"grep -qx {shlex.quote(ctx.spec_hash)} {path} 2>/dev/null", timeout=120, on_host=True)
