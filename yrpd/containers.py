"""Container profiles (`containers/*.yaml`) and the `docker run` command rendered from them (pure).

A profile is data: the image, privileges, networking, shared memory, the device nodes every planned NPU needs,
the host's driver and tool mounts, and the container's environment. `container_run()` turns a profile plus
what the deployment adds (the planned NPUs, the model and session directories, the session id) into the
argument vector of `docker run` and a hash of that container spec. The container carries the hash as the
label `yrpd.spec`; a later deploy reuses a container whose label matches and refuses one that differs
(unless `--recreate`). The hash covers everything that shapes the container except its labels and which
of the base image and yrpd's derived image (see `derived_image`) it was started from.

Nothing here touches a host: yrpd/steps/container.py runs the result through deploy_scripts/container_runtime.py.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from yrpd.errors import SpecError
from yrpd.assets import container_profiles_dir

PROFILE_SCHEMA = "yrpd.container-profile/1"
FIELD = "container_profile"

_SIZE_RE = re.compile(r"^[1-9][0-9]*[bkmg]?$")
_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_NAME_RE = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]*$")
_TAG_RE = re.compile(r"[^A-Za-z0-9_.-]")


_REPO_RE = re.compile(r"^[a-z0-9][a-z0-9._/:-]*$")
_IMAGE_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


#: the profile whose image NPU hosts run under runtime auto: the newest vllm-ascend release (0.30.0rc2 is a
#: pre-release; `--image quay.io/ascend/vllm-ascend:v0.30.0rc2` picks its profile)
DEFAULT_NPU_PROFILE = "vllm-ascend-v0.23.0"


def default_npu_image() -> str:
    return load_profile(DEFAULT_NPU_PROFILE).image


def check_image(image: str) -> None:
    """ValueError unless `image` looks like repo[:tag][@sha256:...] (docker's rules, loosely)."""
    name, _, digest = image.partition("@")
    repo, tag = name, None
    if ":" in name.rsplit("/", 1)[-1]:
        repo, _, tag = name.rpartition(":")
    if (not _REPO_RE.match(repo) or (tag is not None and not _IMAGE_TAG_RE.match(tag))
            or (digest and not re.match(r"^sha256:[0-9a-f]{64}$", digest))):
        raise ValueError(f"{image!r} is not an image reference like registry/repo:tag")


class Mount(BaseModel):
    """A bind mount from the host; `target` defaults to the same path."""

    model_config = ConfigDict(extra="forbid")

    source: str
    target: str | None = None
    read_only: bool = False
    #: multi_host: only when an instance's ranks span more than one host (HCCL between hosts; a PD deployment
    #: whose instances each fit one host hands KV over through the data system and needs no HCCL networking)
    when: Literal["always", "multi_host"] = "always"
    #: the source may be missing and is then created as an empty directory; otherwise preflight requires it
    #: (docker would silently create a directory in place of a missing file: a container that starts and
    #: then produces garbage)
    create: bool = False
    purpose: str = ""

    @field_validator("source", "target")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        if value is not None and (not value.startswith("/") or ":" in value or "," in value):
            raise ValueError(f"{value!r} must be an absolute path without ':' or ','")
        return value

    @property
    def dest(self) -> str:
        return self.target or self.source

    def flag(self) -> list[str]:
        return ["-v", f"{self.source}:{self.dest}" + (":ro" if self.read_only else "")]


class Profile(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    schema_: Literal["yrpd.container-profile/1"] = Field(alias="schema")
    name: str
    description: str = ""
    image: str
    #: the vllm-ascend source tree in the image, where the patch series applies; null: nothing to patch
    source_tree: str | None = None
    #: shell command run in source_tree after the series changed it; null: the package is installed editable
    reinstall: str | None = None
    privileged: bool = False
    #: yrpd plans ports on the hosts' addresses: only host networking fits
    network: Literal["host"] = "host"
    ipc: Literal["host"] | None = None
    shm_size: str | None = None
    #: run a reaper as PID 1 (`--init`): services started by `docker exec` are orphaned into the container
    init: bool = True
    #: device node of one planned NPU; {id} is the NPU id
    npu_device: str = "/dev/davinci{id}"
    devices: list[str] = []
    mounts: list[Mount] = []
    env: dict[str, str] = {}
    #: scripts the image's entrypoint or login shell sources (CANN's set_env.sh): `docker exec` runs neither, so
    #: yrpd sources them, in order, before every command it runs in the container
    env_scripts: list[str] = []
    #: what keeps the container alive; services are started in it with `docker exec`
    command: list[str] = ["sleep", "infinity"]
    #: the image's Python that has vLLM: the instances, the proxy and yrpd's connector run with it (not a venv:
    #: the images install vLLM into a system Python of their own)
    python: str = "python3"
    #: its version, X.Y: which data-system client wheel yrpd brings into the image for the connector
    python_version: str = "3.11"
    #: the Python the openYuanrong venvs (the data system; the yr CLI under cluster_launcher yr) are made from in
    #: the container; default `python`. openyuanrong-datasystem has wheels for 3.11 and 3.12, the yr CLI
    #: (openyuanrong) for 3.10 and 3.11 only
    cluster_python: str | None = None
    cluster_python_version: str | None = None
    #: the vllm-ascend release the image ships (X.Y.Z, rcN allowed): which of its connectors yrpd may use
    #: (`kv_connector: ascend-store`) and the compatibility matrix's row
    vllm_ascend: str | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _NAME_RE.match(value):
            raise ValueError(f"{value!r} must be letters, digits, . _ -")
        return value

    @field_validator("image")
    @classmethod
    def _image(cls, value: str) -> str:
        check_image(value)
        return value

    @field_validator("shm_size")
    @classmethod
    def _size(cls, value: str | None) -> str | None:
        if value is not None and not _SIZE_RE.match(value.lower()):
            raise ValueError(f"{value!r} is not a size like 64g, 512m")
        return value

    @field_validator("npu_device")
    @classmethod
    def _npu_device(cls, value: str) -> str:
        if not value.startswith("/dev/") or "{id}" not in value:
            raise ValueError(f"{value!r} must be a path under /dev/ containing {{id}}")
        return value

    @field_validator("devices")
    @classmethod
    def _devices(cls, value: list[str]) -> list[str]:
        for path in value:
            if not path.startswith("/dev/"):
                raise ValueError(f"{path!r} is not a device node under /dev/")
        return value

    @field_validator("env", mode="before")
    @classmethod
    def _env(cls, value: Any) -> Any:
        if isinstance(value, dict):
            for key in value:
                if not _ENV_RE.match(str(key)):
                    raise ValueError(f"{key!r} is not an environment variable name")
            return {str(k): "" if v is None else str(v) for k, v in value.items()}
        return value

    @field_validator("python_version", "cluster_python_version")
    @classmethod
    def _py_version(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^3\.[0-9]{1,2}$", str(value)):
            raise ValueError(f"{value!r} is not a Python version like 3.11")
        return value

    @field_validator("env_scripts")
    @classmethod
    def _scripts(cls, value: list[str]) -> list[str]:
        for path in value:
            if not path.startswith("/"):
                raise ValueError(f"{path!r} must be an absolute path in the image")
        return value

    @property
    def cluster_interpreter(self) -> tuple[str, str]:
        """(path, X.Y) of the Python the openYuanrong venvs are made from."""
        if self.cluster_python:
            return self.cluster_python, self.cluster_python_version or self.python_version
        return self.python, self.python_version

    @field_validator("command")
    @classmethod
    def _command(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("must name a program, e.g. [sleep, infinity]")
        return value

    @model_validator(mode="after")
    def _unique_targets(self) -> "Profile":
        seen: set[str] = set()
        for mount in self.mounts:
            if mount.dest in seen:
                raise ValueError(f"mounts: {mount.dest} is mounted twice")
            seen.add(mount.dest)
        return self

    def mounts_for(self, multi_host: bool) -> list[Mount]:
        return [m for m in self.mounts if m.when == "always" or multi_host]

    def npu_nodes(self, npus: list[int] | tuple[int, ...]) -> list[str]:
        return [self.npu_device.format(id=i) for i in npus]


# -- loading ---------------------------------------------------------------------------------------

def profiles_dir() -> Path:
    return container_profiles_dir()


def profile_names() -> list[str]:
    return sorted(p.stem for p in profiles_dir().glob("*.yaml"))


def load_profile(ref: str) -> Profile:
    """A shipped profile by name, or a profile file by path (anything with a '/' or ending in .yaml)."""
    if "/" in ref or ref.endswith((".yaml", ".yml")):
        path = Path(ref).expanduser()
        if not path.is_file():
            raise SpecError(FIELD, f"{ref} does not exist", "pass a profile name (" + ", ".join(profile_names()) +
                            ") or the path of a profile file")
    else:
        path = profiles_dir() / f"{ref}.yaml"
        if not path.is_file():
            raise SpecError(FIELD, f"{ref!r} is not a shipped profile", "use one of " + ", ".join(profile_names()) +
                            ", or the path of a profile file")
    return _load(str(path.resolve()), path.stat().st_mtime_ns)


@lru_cache(maxsize=32)
def _load(path: str, _mtime: int) -> Profile:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise SpecError(FIELD, f"{path} is not valid YAML{where}: {getattr(exc, 'problem', None) or exc}",
                        "fix the file's syntax") from None
    if not isinstance(data, dict):
        raise SpecError(FIELD, f"{path} must hold a mapping", "see containers/ for the format")
    try:
        return Profile.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or "profile"
        if err["type"] == "extra_forbidden":
            problem = "is not a known setting"
        elif err["type"] == "missing":
            problem = "is required"
        elif err["type"] == "literal_error" and loc == "schema":
            problem = f"must be {PROFILE_SCHEMA}"
        else:
            problem = err["msg"].removeprefix("Value error, ")
        raise SpecError(FIELD, f"{path}: {loc}: {problem}", "see docs/dev/containers.md for the profile format") from None


def profile_for_image(image: str) -> Profile | None:
    """The shipped profile made for exactly this image, if any."""
    for name in profile_names():
        profile = load_profile(name)
        if profile.image == image:
            return profile
    return None


def container_profile(spec) -> Profile:
    """The profile a docker-runtime deployment uses: the spec's, else the shipped one made for its image."""
    if spec.container_profile:
        return load_profile(spec.container_profile)
    profile = profile_for_image(spec.image)
    if profile is None:
        raise SpecError(FIELD, f"no shipped profile is made for image {spec.image}",
                        "pass --container-profile with one of " + ", ".join(profile_names()) +
                        " (its flags, your image) or the path of your own profile file")
    return profile


# -- rendering -------------------------------------------------------------------------------------

def container_name(session_id: str) -> str:
    """One container per host and session: the same name on every host."""
    name = f"yrpd-{session_id}"
    if not _NAME_RE.match(name):
        raise ValueError(f"session id {session_id!r} does not make a container name")
    return name


@dataclass(frozen=True)
class ContainerRun:
    """A rendered `docker run`: the full argument vector, the hashed spec, and the hash."""

    argv: list[str]
    spec: list[str]  # options, image and command: what the hash covers (no labels, the base image)
    spec_hash: str
    image_index: int  # position of the image in argv (a derived image may take its place)


def spec_hash(spec: list[str]) -> str:
    return hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:16]


def container_run(profile: Profile, *, name: str, image: str | None = None, npus: list[int] | tuple[int, ...] = (),
                  mounts: list[Mount] | tuple[Mount, ...] = (), env: dict[str, str] | None = None,
                  multi_host: bool = False, session_id: str | None = None, engine: str = "docker",
                  run_image: str | None = None) -> ContainerRun:
    """Render `engine run` for one host. `image` defaults to the profile's; `run_image` (a derived image of it)
    replaces it in argv only, so a container started from either has the same spec hash."""
    if not _NAME_RE.match(name):
        raise ValueError(f"container name {name!r} must be letters, digits, . _ -")
    image = image or profile.image
    options = ["--name", name]
    if profile.init:
        options.append("--init")
    if profile.privileged:
        options.append("--privileged")
    options.append(f"--net={profile.network}")
    if profile.ipc:
        options.append(f"--ipc={profile.ipc}")
    if profile.shm_size:
        options += ["--shm-size", profile.shm_size]
    for node in profile.npu_nodes(sorted(npus)) + profile.devices:
        options += ["--device", node]
    targets: set[str] = set()
    for mount in [*profile.mounts_for(multi_host), *mounts]:
        if mount.dest in targets:
            raise ValueError(f"{mount.dest} is mounted twice (profile {profile.name} and the deployment)")
        targets.add(mount.dest)
        options += mount.flag()
    for key, value in {**profile.env, **(env or {})}.items():
        options += ["-e", f"{key}={value}"]
    options += ["--entrypoint", profile.command[0]]
    spec = [*options, image, *profile.command[1:]]
    digest = spec_hash(spec)
    labels = {"yrpd.spec": digest, "yrpd.profile": profile.name, "yrpd.image": image, "yrpd.args": json.dumps(spec, separators=(",", ":"))}
    if session_id:
        labels["yrpd.session"] = session_id
    label_flags = [word for key, value in labels.items() for word in ("--label", f"{key}={value}")]
    head = [engine, "run", "-d", "--pull", "never", *options[:2], *label_flags, *options[2:]]
    argv = [*head, run_image or image, *profile.command[1:]]
    return ContainerRun(argv=argv, spec=spec, spec_hash=digest, image_index=len(head))


def render_docker_run(profile: Profile, **kwargs: Any) -> list[str]:
    """The `docker run` argument vector (see container_run for the arguments)."""
    return container_run(profile, **kwargs).argv


# -- derived images --------------------------------------------------------------------------------

def split_image(image: str) -> tuple[str, str]:
    """'registry:5000/repo/name:tag' -> ('registry:5000/repo/name', 'tag'); no tag -> 'latest';
    a digest reference keeps its first 12 hex digits as the tag."""
    if "@" in image:
        repo, _, digest = image.partition("@")
        return repo, digest.replace(":", "-")[:19]
    last = image.rsplit("/", 1)[-1]
    if ":" in last:
        repo, _, tag = image.rpartition(":")
        return repo, tag
    return image, "latest"


def derived_image(base: str, inputs: dict[str, Any]) -> str:
    """The tag of yrpd's derived image: the base image's name and tag plus a hash of what yrpd put into it
    (patch series, packages and their versions). Same inputs, same tag: later deploys start from it."""
    repo, tag = split_image(base)
    digest = hashlib.sha256(json.dumps({"base": base, **inputs}, sort_keys=True).encode()).hexdigest()[:12]
    return f"{repo}:{_TAG_RE.sub('-', tag)[:100]}-yrpd-{digest}"
