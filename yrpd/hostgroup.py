"""The one place where yrpd acts on hosts: run shell commands over SSH (Fabric) or locally, in parallel.

A `HostGroup` runs one command per host concurrently and returns a `GroupResult` mapping host name to
`HostResult`. `GroupResult.raise_on_failure()` raises a single `GroupFailure` that carries every failed
host's command, exit code and stderr tail, while the successful hosts' results stay available.

Rules that keep remote work predictable:
- every command runs under the remote `timeout` (Fabric's own timeout leaves the remote command running);
- stdin is never forwarded (`in_stream=False`), so it works under pytest, CI and cron;
- host keys are checked against known_hosts (Fabric accepts any key by default); unknown keys are
  refused unless `accept_new_host_keys`, which appends them to known_hosts;
- `localhost` runs through a local shell, without SSH.

With the docker runtime a host's commands run inside that host's container: `HostGroup.in_containers()` gives
a view of the group whose runners are `ContainerRunner`s, which wrap each command into `docker exec` on the host
(as Ray's cluster launcher keeps its SSH and Docker command runners apart). A command marked `on_host` (preflight,
creating and removing the container) still runs on the host itself.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Mapping

from pydantic import BaseModel, ConfigDict

from yrpd.errors import RemoteError

STDERR_TAIL_LINES = 20


class SshOptions(BaseModel):
    """How connections are made (the spec's `ssh:` section, and the CLI's ssh flags)."""

    model_config = ConfigDict(extra="forbid")

    #: ssh_config file for host aliases (`--ssh-config`)
    config_file: str = "~/.ssh/config"
    #: private key for this host (or, under ssh:, for every host) (`-i`)
    identity: str | None = None
    #: host keys are checked against this file (`--known-hosts`)
    known_hosts: str = "~/.ssh/known_hosts"
    #: append unknown host keys instead of refusing (`--accept-new-host-keys`)
    accept_new_host_keys: bool = False
    #: seconds to wait for an SSH connection
    connect_timeout: float = 10.0


@dataclass(frozen=True)
class Host:
    """Connection facts for one host (resolved from the spec)."""

    name: str
    hostname: str
    user: str | None = None
    port: int | None = None
    identity: str | None = None
    local: bool = False


@dataclass(frozen=True)
class Command:
    """A shell script to run on a host, and how a person reading the plan should see it."""

    script: str
    display: str | None = None
    timeout: float = 120
    #: run on the host even where the host's commands go into its container (docker runtime)
    on_host: bool = False
    #: (file or directory here, path on the host) copied before the script runs; a file the host already has at
    #: that size is not copied again
    uploads: tuple[tuple[str, str], ...] = ()
    #: copy the uploads even where the host has a file of that size (secrets: same length, new content)
    fresh_uploads: bool = False

    def __str__(self) -> str:
        return self.display or self.script


@dataclass
class HostResult:
    host: str
    command: str
    exit_code: int | None
    stdout: str = ""
    stderr: str = ""
    error: str | None = None  # set when the host could not be reached or the command could not start
    duration: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None and self.exit_code == 0

    @property
    def reachable(self) -> bool:
        return self.error is None

    def tail(self, lines: int = STDERR_TAIL_LINES) -> str:
        """The end of stderr (or stdout), keeping the first line: scripts put their headline there."""
        text = self.error or self.stderr.strip() or self.stdout.strip()
        all_lines = text.splitlines()
        if len(all_lines) <= lines:
            return text
        return "\n".join([all_lines[0], "..."] + all_lines[-(lines - 1):])

    def summary(self) -> str:
        if self.error:
            return f"{self.host}: {self.error}"
        first = self.tail(STDERR_TAIL_LINES)
        reason = f"exit {self.exit_code}" + (" (timed out)" if self.exit_code in (124, 137) else "")
        return f"{self.host}: {reason}" + (f"\n    " + first.replace("\n", "\n    ") if first else "")


class GroupFailure(RemoteError):
    """One or more hosts failed; `results` holds every host's result, `failed` only the failures."""

    def __init__(self, what: str, results: Mapping[str, HostResult]):
        self.what = what
        self.results = dict(results)
        self.failed = {name: r for name, r in results.items() if not r.ok}
        lines = [f"{what} failed on {len(self.failed)} of {len(self.results)} host(s):"]
        for name in sorted(self.failed):
            lines.append("  " + self.failed[name].summary())
        ok = sorted(n for n, r in self.results.items() if r.ok)
        if ok:
            lines.append(f"  succeeded on: {', '.join(ok)}")
        super().__init__("\n".join(lines))


class GroupResult(dict[str, HostResult]):
    @property
    def failed(self) -> dict[str, HostResult]:
        return {n: r for n, r in self.items() if not r.ok}

    @property
    def ok(self) -> bool:
        return not self.failed

    def raise_on_failure(self, what: str) -> "GroupResult":
        if self.failed:
            raise GroupFailure(what, self)
        return self


def wrap_timeout(script: str, seconds: float) -> str:
    """Run `script` under coreutils timeout on the host; KILL follows TERM after 10 s."""
    return f"timeout -k 10 {int(max(1, seconds))} bash -c {shlex.quote(script)}"


#: what a checked command prints, and all it prints, where its check passed (the step is already done)
ALREADY_DONE = "yrpd: the step's check passed: already done"


@dataclass(frozen=True)
class CheckedCommand(Command):
    """`step` behind its `check`, in one round trip: exit 0 printing ALREADY_DONE where the check passes (its own
    output dropped, under its own timeout), else the step. `script` is what the host runs; the parts stay for
    reports and for scripted hosts (yrpd.testing), which answer each part as its own command."""

    check: Command | None = None
    step: Command | None = None

    @classmethod
    def of(cls, check: Command, step: Command) -> "CheckedCommand":
        # the check travels as a here-document into a file, not quoted into the line: quoting it for `bash -c`
        # inside a command that is quoted again for the host's shell grows every ' in it fivefold, twice, and the
        # whole command is one exec argument, which Linux bounds (MAX_ARG_STRLEN, 128 KiB)
        assert "YRPD_CHECK_END" not in check.script
        script = (f"yrpd_check=$(mktemp) && cat > \"$yrpd_check\" <<'YRPD_CHECK_END'\n{check.script}\nYRPD_CHECK_END\n"
                  f"if timeout -k 10 {int(max(1, check.timeout))} bash \"$yrpd_check\" >/dev/null 2>&1; then "
                  f"rm -f \"$yrpd_check\"; echo {shlex.quote(ALREADY_DONE)}; exit 0; fi\n"
                  f"rm -f \"$yrpd_check\"\n{step.script}")
        return cls(script, step.display or step.script, step.timeout + check.timeout, step.on_host, step.uploads,
                   step.fresh_uploads, check, step)

    @staticmethod
    def already_done(result: "HostResult") -> bool:
        return result.ok and result.stdout.strip().splitlines()[-1:] == [ALREADY_DONE]


#: seconds the host-side timeout of a `docker exec` waits beyond the command's own (which runs in the container)
CONTAINER_EXEC_GRACE = 20
#: exit status of a command whose container is not running (docker's own "cannot run" code)
CONTAINER_DOWN = 125


def upload_pairs(local: str, remote: str) -> list[tuple[Path, str]]:
    """(file here, path there) for a file, or for each file of a directory (not recursive)."""
    path = Path(local)
    if path.is_dir():
        return [(f, f"{remote.rstrip('/')}/{f.name}") for f in sorted(path.iterdir()) if f.is_file()]
    return [(path, remote)]


def on_host(command: Command) -> Command:
    """The same command, marked to run on the host itself under the docker runtime."""
    return replace(command, on_host=True)


def env_preamble(scripts: Iterable[str]) -> str:
    """Shell lines sourcing what the image's entrypoint would have (CANN's set_env.sh): `docker exec` skips it."""
    return "".join(f"[ -f {shlex.quote(f)} ] && . {shlex.quote(f)} >/dev/null\n" for f in scripts)


def container_exec(command: Command, container: str, engine: str = "docker", absent_ok: bool = False,
                   preamble: str = "") -> Command:
    """`command` run inside `container` on its host: `ENGINE exec CONTAINER timeout ... bash -c SCRIPT`.

    The command's timeout is applied inside the container (killing the `docker exec` client would leave the
    command running there); the host-side timeout the runner adds is a backstop a little longer. No `-i`/`-t`:
    scripts carry their input as here-documents. A container that is not running gives exit 125 and a line
    naming it, or, with `absent_ok` (teardown: nothing of the session can run in it), exit 0 and a note.
    """
    q = shlex.quote
    name = q(container)
    if absent_ok:
        down = f"echo \"container {container} is not running on $(uname -n): nothing to do in it\"; exit 0"
    else:
        down = (f"echo \"container {container} is not running on $(uname -n) (deploy creates it: "
                f"run the same yrpd deploy again)\" >&2; exit {CONTAINER_DOWN}")
    script = "\n".join([
        f"if [ \"$({engine} inspect -f '{{{{.State.Running}}}}' {name} 2>/dev/null)\" != true ]; then {down}; fi",
        f"exec {engine} exec {name} {wrap_timeout(preamble + command.script, command.timeout)}",
    ])
    # uploads land on the host: the paths yrpd uploads to (the session root) are mounted into the container
    return Command(script, display=f"in container {container}: {command}",
                   timeout=command.timeout + CONTAINER_EXEC_GRACE, on_host=True, uploads=command.uploads,
                   fresh_uploads=command.fresh_uploads)


#: the environment of yrpd's own Python, which must not reach what runs on a local host (an SSH login has none of it)
_CONTROLLER_ONLY = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")


def local_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _CONTROLLER_ONLY}


def part_name(name: str) -> str:
    """The name an upload is written under before its rename: its own for each upload, because hosts may share
    the directory (an NFS session root) and their uploads run at once."""
    return f".{name}.{uuid.uuid4().hex[:12]}.part"


def write_into_place(target: Path, write: Callable[[Path], None]) -> None:
    """`write` a file under a part name of its own beside `target`, then rename it into place: writers at once (the
    hosts' threads, hosts sharing a directory) never meet, and a failed write leaves no part file."""
    part = target.with_name(part_name(target.name))
    try:
        write(part)
        part.rename(target)
    except BaseException:
        part.unlink(missing_ok=True)
        raise


class LocalRunner:
    def __init__(self, host: Host):
        self.host = host
        self._streams: set[subprocess.Popen] = set()

    def upload(self, local: str, remote: str, fresh: bool = False) -> None:
        for source, dest in upload_pairs(local, remote):
            target = Path(dest)
            if not fresh and target.is_file() and target.stat().st_size == source.stat().st_size:
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            write_into_place(target, lambda part, source=source: shutil.copyfile(source, part))

    def run(self, command: Command, on_line: Callable[[str, str], None] | None = None) -> HostResult:
        started = time.monotonic()
        wrapped = wrap_timeout(command.script, command.timeout)
        try:
            for local, remote in command.uploads:
                self.upload(local, remote, command.fresh_uploads)
            if on_line is None:
                proc = subprocess.run(
                    ["bash", "-c", wrapped], stdin=subprocess.DEVNULL, capture_output=True, text=True, errors="replace",
                    env=local_env(),
                )
                return HostResult(self.host.name, str(command), proc.returncode, proc.stdout, proc.stderr,
                                  duration=time.monotonic() - started)
            proc = subprocess.Popen(
                ["bash", "-c", wrapped], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True, errors="replace", start_new_session=True, env=local_env(),
            )
            self._streams.add(proc)
            try:
                assert proc.stdout is not None
                for line in proc.stdout:
                    on_line(self.host.name, line.rstrip("\n"))
            finally:
                self._kill(proc)
                self._streams.discard(proc)
            return HostResult(self.host.name, str(command), proc.returncode, duration=time.monotonic() - started)
        except OSError as exc:
            return HostResult(self.host.name, str(command), None, error=f"cannot run locally: {exc}")

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, 15)
            except ProcessLookupError:
                pass
        proc.wait()

    def close(self) -> None:
        for proc in list(self._streams):
            self._kill(proc)


class _LineWriter:
    """File-like sink for Fabric's out_stream that calls back once per complete line."""

    def __init__(self, host: str, on_line: Callable[[str, str], None]):
        self.host = host
        self.on_line = on_line
        self.buffer = ""

    def write(self, data: str) -> int:
        self.buffer += data
        while "\n" in self.buffer:
            line, self.buffer = self.buffer.split("\n", 1)
            self.on_line(self.host, line)
        return len(data)

    def flush(self) -> None:
        pass


class SshRunner:
    def __init__(self, host: Host, options: SshOptions):
        self.host = host
        self.options = options
        self._conn = None

    def _connection(self):
        if self._conn is None:
            import paramiko
            from fabric import Config, Connection

            ssh_config = Path(self.options.config_file).expanduser()
            config = Config(runtime_ssh_path=str(ssh_config)) if ssh_config.is_file() else Config()
            config.load_ssh_config()
            connect_kwargs: dict = {"banner_timeout": self.options.connect_timeout,
                                    "auth_timeout": self.options.connect_timeout}
            identity = self.host.identity or self.options.identity
            if identity:
                connect_kwargs["key_filename"] = [str(Path(identity).expanduser())]
            conn = Connection(
                self.host.hostname, user=self.host.user, port=self.host.port, config=config,
                connect_kwargs=connect_kwargs, connect_timeout=self.options.connect_timeout,
            )
            known_hosts = Path(self.options.known_hosts).expanduser()
            if known_hosts.is_file():
                conn.client.load_host_keys(str(known_hosts))
                # paramiko rewrites the whole file on save; we only ever append (see AppendNewHostKey)
                conn.client._host_keys_filename = None
            if self.options.accept_new_host_keys:
                conn.client.set_missing_host_key_policy(AppendNewHostKey(known_hosts))
            else:
                conn.client.set_missing_host_key_policy(paramiko.RejectPolicy())
            self._conn = conn
        return self._conn

    def upload(self, local: str, remote: str, fresh: bool = False) -> None:
        """Copy a file over SFTP unless the host has it at that size (`fresh`: always); written beside, then renamed
        into place."""
        conn = self._connection()
        sftp = conn.sftp()
        made: set[str] = set()
        for source, dest in upload_pairs(local, remote):
            try:
                if not fresh and sftp.stat(dest).st_size == source.stat().st_size:
                    continue
            except OSError:
                pass
            parent = str(Path(dest).parent)
            if parent not in made:
                conn.run(f"mkdir -p {shlex.quote(parent)}", hide=True, in_stream=False)
                made.add(parent)
            part = f"{parent}/{part_name(Path(dest).name)}"
            try:
                sftp.put(str(source), part)
                sftp.posix_rename(part, dest)
            except BaseException:
                with contextlib.suppress(Exception):  # a lost link leaves it to the session's removal
                    sftp.remove(part)
                raise

    def run(self, command: Command, on_line: Callable[[str, str], None] | None = None) -> HostResult:
        started = time.monotonic()
        wrapped = wrap_timeout(command.script, command.timeout)
        try:
            conn = self._connection()
            for local, remote in command.uploads:
                self.upload(local, remote, command.fresh_uploads)
            kwargs: dict = {"hide": True, "warn": True, "in_stream": False, "pty": False}
            if on_line is not None:
                sink = _LineWriter(self.host.name, on_line)
                kwargs.update(out_stream=sink, err_stream=sink)
            result = conn.run(wrapped, **kwargs)
            return HostResult(self.host.name, str(command), result.exited, result.stdout, result.stderr,
                              duration=time.monotonic() - started)
        except Exception as exc:  # connection-level failures: report them per host, never crash the group
            return HostResult(self.host.name, str(command), None, error=describe_ssh_error(self.host, self.options, exc),
                              duration=time.monotonic() - started)

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            finally:
                self._conn = None


def as_run_in(command: Command, container: str, engine: str = "docker", absent_ok: bool = False,
              preamble: str = "") -> Command:
    """What runs on the host for a step's command under the docker runtime: the command itself when it is
    marked on_host, otherwise the command inside the container (after `preamble`)."""
    return command if command.on_host else container_exec(command, container, engine, absent_ok, preamble)


class ContainerRunner:
    """Runs a host's commands inside its container through the host's own runner (SSH or local), except those
    marked `on_host`."""

    def __init__(self, inner: "LocalRunner | SshRunner", container: str, engine: str = "docker",
                 absent_ok: bool = False, preamble: str = ""):
        self.inner = inner
        self.container = container
        self.engine = engine
        self.absent_ok = absent_ok
        self.preamble = preamble

    def run(self, command: Command, on_line: Callable[[str, str], None] | None = None) -> HostResult:
        result = self.inner.run(as_run_in(command, self.container, self.engine, self.absent_ok, self.preamble),
                                on_line)
        result.command = str(command)  # the report names the step's command, not its docker exec wrapper
        return result

    def close(self) -> None:
        self.inner.close()


class AppendNewHostKey:
    """paramiko missing-host-key policy for --accept-new-host-keys: trust on first use, append to known_hosts."""

    _lock = threading.Lock()

    def __init__(self, known_hosts: Path):
        self.known_hosts = known_hosts

    def missing_host_key(self, client, hostname, key):
        from paramiko.hostkeys import HostKeyEntry

        client.get_host_keys().add(hostname, key.get_name(), key)
        with self._lock:
            self.known_hosts.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            with open(self.known_hosts, "a") as fh:
                fh.write(HostKeyEntry([hostname], key).to_line())


def describe_ssh_error(host: Host, options: SshOptions, exc: Exception) -> str:
    import socket

    import paramiko

    target = f"{host.user + '@' if host.user else ''}{host.hostname}{':' + str(host.port) if host.port else ''}"
    if isinstance(exc, paramiko.SSHException) and "not found in known_hosts" in str(exc):
        return (f"host key of {target} is not in {options.known_hosts}: refusing to connect; "
                f"check the key and add it (ssh-keyscan), or pass --accept-new-host-keys")
    if isinstance(exc, paramiko.BadHostKeyException):
        return f"host key of {target} does not match {options.known_hosts}: possible man-in-the-middle; fix known_hosts"
    if isinstance(exc, paramiko.AuthenticationException):
        return f"ssh authentication to {target} failed: {exc}; check the user and -i/--identity"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return f"ssh to {target} timed out after {options.connect_timeout:g}s"
    if isinstance(exc, (ConnectionRefusedError, paramiko.ssh_exception.NoValidConnectionsError)):
        return f"ssh to {target} refused: is sshd running on that host and port?"
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve host {host.hostname}: {exc.strerror}"
    if isinstance(exc, OSError):
        return f"ssh to {target} failed: {exc.strerror or exc}"
    return f"ssh to {target} failed: {type(exc).__name__}: {exc}"


@dataclass
class HostGroup:
    """Hosts addressed together. Connections are opened lazily and reused until close()."""

    hosts: list[Host]
    ssh: SshOptions = field(default_factory=SshOptions)
    max_parallel: int = 32

    #: docker runtime: host name -> its container; commands not marked on_host run in it
    containers: dict[str, str] = field(default_factory=dict)
    engine: str = "docker"
    #: teardown: a container that is not running means nothing runs in it (exit 0 instead of 125)
    absent_ok: bool = False
    #: shell lines run in the container before each command (env_preamble of the profile's env_scripts)
    preamble: str = ""

    #: tests: makes the runner of a host instead of a local or SSH one (yrpd.testing scripts the answers)
    runner_factory: Callable[[Host], "LocalRunner | SshRunner"] | None = None
    #: the factory every new group gets (yrpd.testing.ScriptedHosts sets it, like fabric.testing's MockRemote)
    default_runner_factory = None

    def __post_init__(self) -> None:
        if self.runner_factory is None:
            self.runner_factory = HostGroup.default_runner_factory
        self._runners: dict[str, LocalRunner | SshRunner] = {}
        self._lock = threading.Lock()

    def __enter__(self) -> "HostGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def names(self) -> list[str]:
        return [h.name for h in self.hosts]

    def subset(self, names: Iterable[str]) -> "HostGroup":
        wanted = set(names)
        return self._view([h for h in self.hosts if h.name in wanted], self.containers, self.engine, self.absent_ok,
                          self.preamble)

    def in_containers(self, containers: Mapping[str, str], engine: str = "docker",
                      absent_ok: bool = False, preamble: str = "") -> "HostGroup":
        """A view of the same hosts (and connections) whose commands run in the named containers."""
        return self._view(list(self.hosts), dict(containers), engine, absent_ok, preamble)

    def _view(self, hosts: list[Host], containers: Mapping[str, str], engine: str, absent_ok: bool,
              preamble: str = "") -> "HostGroup":
        group = HostGroup(hosts, self.ssh, self.max_parallel, dict(containers), engine, absent_ok, preamble,
                          self.runner_factory)
        group._runners = self._runners  # share open connections
        group._lock = self._lock
        return group

    def _runner(self, host: Host) -> LocalRunner | SshRunner | ContainerRunner:
        with self._lock:
            if host.name not in self._runners:
                if self.runner_factory is not None:
                    self._runners[host.name] = self.runner_factory(host)
                else:
                    self._runners[host.name] = LocalRunner(host) if host.local else SshRunner(host, self.ssh)
            runner = self._runners[host.name]
        if host.name in self.containers:
            return ContainerRunner(runner, self.containers[host.name], self.engine, self.absent_ok, self.preamble)
        return runner

    def run(self, commands: Command | Mapping[str, Command] | Callable[[Host], Command | None],
            on_line: Callable[[str, str], None] | None = None) -> GroupResult:
        """Run on every host in parallel: one command for all, a mapping per host name, or a function of the host.

        A host whose command is None (function form) or absent (mapping form) is left out of the result.
        """
        per_host: dict[str, Command] = {}
        for host in self.hosts:
            if isinstance(commands, Command):
                cmd = commands
            elif callable(commands):
                cmd = commands(host)
            else:
                cmd = commands.get(host.name)
            if cmd is not None:
                per_host[host.name] = cmd
        by_name = {h.name: h for h in self.hosts}
        results = GroupResult()
        if not per_host:
            return results
        pool = ThreadPoolExecutor(max_workers=min(self.max_parallel, len(per_host)))
        try:
            futures = {name: pool.submit(self._runner(by_name[name]).run, cmd, on_line) for name, cmd in per_host.items()}
            for name in per_host:
                results[name] = futures[name].result()
        except KeyboardInterrupt:
            self.close()  # ends streaming commands so the worker threads can finish
            raise
        finally:
            pool.shutdown(wait=True)
        return results

    def close(self) -> None:
        with self._lock:
            for runner in self._runners.values():
                runner.close()
            self._runners.clear()
