"""Deploy and teardown steps. Each step is a pair of pure functions of (context, host):

- `run(ctx, host, **args) -> Command | NotNeeded` builds the shell script that does the work on that host;
- an optional check `(ctx, host, **args) -> Command | NotNeeded` whose exit status 0 means "already done, skip".

`NotNeeded(reason)` says the step has nothing to do on that host (a container step under the host runtime);
the host is skipped without a round trip and deploy's progress and `yrpd plan` show the reason.

Playbooks (playbooks/*.yaml) name them as `module.function` relative to this package. Nothing here
touches a host: yrpd.playbook runs the commands through yrpd.hostgroup, and `yrpd plan` prints them.
"""

from __future__ import annotations

import importlib
import json
import shlex
from dataclasses import dataclass, field, fields
from typing import Any, Callable

from yrpd.assets import deploy_script
from yrpd.containers import Profile, container_profile
from yrpd.hostgroup import Command
from yrpd.layout import HostSessionLayout
from yrpd.placement import HostPlan, Plan
from yrpd.spec import DeploySpec

SESSION_PLACEHOLDER = "SESSION_ID"


@dataclass(frozen=True)
class RunOptions:
    """What one run of a playbook was asked beyond the spec (not part of the deployment's identity). A playbook
    step's `when:` names one of the flags."""

    recreate: bool = False  # replace a container of this session whose spec differs (runtime docker)
    pull: str = "never"  # pull the image: never | missing | always (runtime docker)
    secrets_dir: str | None = None  # where the deployment's secrets are kept on this machine
    purge: bool = False  # teardown: remove the session's directories and container too

    @classmethod
    def flags(cls) -> set[str]:
        return {f.name for f in fields(cls) if f.type in ("bool", bool)}


@dataclass
class StepContext:
    spec: DeploySpec
    plan: Plan
    session_id: str = SESSION_PLACEHOLDER
    options: RunOptions = field(default_factory=RunOptions)

    @property
    def layout(self) -> HostSessionLayout:
        return HostSessionLayout(self.spec.remote_session_root, self.session_id)

    @property
    def host_session_dir(self) -> str:
        return self.layout.dir

    @property
    def spec_hash(self) -> str:
        return self.spec.fingerprint()

    @property
    def profile(self) -> Profile:
        """The container profile a docker-runtime deployment runs with (SpecError where the image has none)."""
        return container_profile(self.spec)

    def host_spec(self, host: HostPlan):
        return self.spec.host(host.name)


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


@dataclass(frozen=True)
class ScriptCall:
    """One of deploy_scripts/*.py with its JSON argument, to run inside one interpreter with others."""

    script: str
    args: dict
    timeout: float = 30


def host_python_parts(parts: dict[str, ScriptCall], python: str = "python3") -> Command:
    """Run several deploy_scripts in ONE host interpreter (each as its own __main__, with its own argument) and print
    one JSON object {part: the last JSON line the part printed}. A part that fails (exit status, or no JSON line)
    is named on stderr, with its own stderr before it, and the command exits 1.

    For queries that run often on every host (`yrpd status`): an interpreter's start and the shell around it cost
    more CPU than a status script's own work. `-S`: the scripts need the standard library only, and a host's
    site-packages can cost more to import than the whole query (certifi's .pth: 28 ms of the 50 ms a bare start
    took on a lab host, `python3 -X importtime`)."""
    sources = {c.script: deploy_script(c.script) for c in parts.values()}
    calls = {name: [c.script, json.dumps(c.args, sort_keys=True)] for name, c in parts.items()}
    body = (
        "import contextlib, io, json, sys, traceback\n"
        f"SOURCES = {sources!r}\n"
        f"CALLS = {calls!r}\n"
        "answers, failed = {}, []\n"
        "for name, (script, arg) in CALLS.items():\n"
        "    sys.argv, out, code = [script, arg], io.StringIO(), 0\n"
        "    try:\n"
        "        with contextlib.redirect_stdout(out):\n"
        "            exec(compile(SOURCES[script], 'deploy_scripts/' + script, 'exec'), {'__name__': '__main__'})\n"
        "    except SystemExit as e:\n"
        "        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)\n"
        "        if not isinstance(e.code, (int, type(None))):\n"
        "            print(e.code, file=sys.stderr)\n"
        "    except Exception:\n"
        "        traceback.print_exc()\n"
        "        code = 1\n"
        "    lines = [l for l in out.getvalue().splitlines() if l.startswith('{')]\n"
        "    answers[name] = json.loads(lines[-1]) if lines and code == 0 else None\n"
        "    if answers[name] is None:\n"
        "        failed.append(name)\n"
        "print(json.dumps(answers))\n"
        "if failed:\n"
        "    print('status query: the ' + ', '.join(failed) + ' part failed', file=sys.stderr)\n"
        "    sys.exit(1)\n"
    )
    assert "YRPD_SCRIPT_END" not in body
    py = shlex.quote(python)
    names = " ".join(f"deploy_scripts/{c.script}" for c in parts.values())
    script = (
        f"# {names}\n"  # names the scripts in the command (for yrpd.testing)
        f'command -v {py} >/dev/null 2>&1 || {{ echo "{python} not found (PATH $PATH); install python3 (3.8+)" >&2; '
        "exit 127; }\n"
        f"{py} -S - <<'YRPD_SCRIPT_END'\n{body}YRPD_SCRIPT_END\n"
        "status=$?; [ $status -eq 0 ] || exit $status\n"
    )
    shown = "; ".join(f"{name}: {python} deploy_scripts/{c.script} {json.dumps(c.args, sort_keys=True)}"
                      for name, c in parts.items())
    return Command(script=script, display=f"one {python} -S running {shown}",
                   timeout=sum(c.timeout for c in parts.values()))


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
