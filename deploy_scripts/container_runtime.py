"""yrpd's container on this host: ensure (create or reuse), commit (the derived image), remove. Stdlib only.

Args: one JSON object (see yrpd/steps/container.py), `action` first. Problems go to stderr as lines that name
this host; exit 1. The container engine is docker or podman (same CLI for everything used here).
"""
import json
import os
import subprocess
import sys
import time

HOST = os.uname().nodename
#: options of `docker run` that take a value (how the spec diff pairs words)
VALUE_FLAGS = {"--name", "--shm-size", "--device", "-v", "-e", "--entrypoint", "--label", "--ipc", "--net", "--pull"}


def fail(message):
    print(f"{HOST}: {message}", file=sys.stderr)
    sys.exit(1)


def engine_cmd(engine, args, timeout=120):
    try:
        return subprocess.run([engine, *args], capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        fail(f"{engine} not found on PATH ({os.environ.get('PATH')}): install it, or pick the engine with "
             f"container_engine in the spec")
    except subprocess.TimeoutExpired:
        fail(f"`{engine} {' '.join(args[:3])} ...` did not finish within {timeout}s")


def tail(proc, lines=8):
    text = (proc.stderr or proc.stdout or "").strip().splitlines()
    return " | ".join(text[-lines:]) or f"exit {proc.returncode}"


def require_engine(engine):
    proc = engine_cmd(engine, ["version"], timeout=30)
    if proc.returncode != 0:
        fail(f"{engine} does not answer (is its daemon running, may this user use it?): {tail(proc, 3)}")


def inspect(engine, kind, name):
    proc = engine_cmd(engine, [kind, "inspect", name], timeout=30)
    if proc.returncode != 0:
        return None
    data = json.loads(proc.stdout or "[]")
    return data[0] if data else None


def labels_of(info):
    return (info.get("Config") or {}).get("Labels") or {}


def option_words(argv):
    """`docker run` arguments as readable items: a flag with its value, the image, command words."""
    items, i, positional = [], 0, False
    while i < len(argv):
        word = argv[i]
        if not positional and word in VALUE_FLAGS and i + 1 < len(argv):
            items.append(f"{word} {argv[i + 1]}")
            i += 2
            continue
        if not positional and word.startswith("-"):
            items.append(word)
        elif not positional:
            items.append(f"image {word}")
            positional = True
        else:
            items.append(f"command word {word}")
        i += 1
    return items


def describe_diff(old, new):
    """What differs between the container's recorded spec and this deploy's, one line."""
    if not old:
        return "the container carries no yrpd spec (made by hand or by an older yrpd)"
    a, b = option_words(old), option_words(new)
    gone = [x for x in a if x not in b]
    added = [x for x in b if x not in a]
    parts = []
    if gone:
        parts.append("only in the existing container: " + ", ".join(gone))
    if added:
        parts.append("only in this deploy: " + ", ".join(added))
    return "; ".join(parts) or "the same arguments in another order"


def wait_running(engine, name, seconds=15):
    deadline = time.monotonic() + seconds
    while True:
        info = inspect(engine, "container", name)
        if info and (info.get("State") or {}).get("Running"):
            return info
        if time.monotonic() > deadline:
            logs = engine_cmd(engine, ["logs", "--tail", "20", name], timeout=30)
            state = (info or {}).get("State") or {}
            fail(f"container {name} is not running after start (status {state.get('Status')}, exit code "
                 f"{state.get('ExitCode')}); its last output: {tail(logs, 20)}")
        time.sleep(0.2)


def choose_image(args):
    """The derived image when it is here and made from the base image as it is now; else the base image,
    pulled first only when --pull says so."""
    engine, base, derived, pull = args["engine"], args["image"], args["derived"], args["pull"]
    base_info = inspect(engine, "image", base)
    if pull == "always" or (pull == "missing" and base_info is None):
        print(f"pulling {base} (--pull {pull})")
        proc = engine_cmd(engine, ["pull", base], timeout=3600)
        if proc.returncode != 0:
            fail(f"cannot pull {base}: {tail(proc, 3)}")
        base_info = inspect(engine, "image", base)
    derived_info = inspect(engine, "image", derived)
    if derived_info:
        made_from = labels_of(derived_info).get("yrpd.base-id")
        if base_info is None or made_from == base_info.get("Id"):
            return derived
        print(f"{derived} was made from another {base} ({made_from}); starting from {base}")
    if base_info is None:
        fail(f"image {base} is not on this host and --pull is {pull}: load it there (docker load -i FILE, or "
             f"docker pull {base}), or deploy with --pull missing")
    return base


def ensure(args):
    engine, name, digest = args["engine"], args["name"], args["spec_hash"]
    require_engine(engine)
    info = inspect(engine, "container", name)
    if info:
        labels = labels_of(info)
        if labels.get("yrpd.spec") == digest:
            if not (info.get("State") or {}).get("Running"):
                proc = engine_cmd(engine, ["start", name])
                if proc.returncode != 0:
                    fail(f"cannot start the existing container {name}: {tail(proc)}")
                wait_running(engine, name)
                print(f"started the existing container {name} (spec {digest})")
            else:
                print(f"reusing container {name} (spec {digest}, image {info.get('Config', {}).get('Image')})")
            return
        old = json.loads(labels.get("yrpd.args") or "[]")
        if not args["recreate"]:
            fail(f"container {name} exists with another spec ({labels.get('yrpd.spec') or 'no yrpd.spec label'}, "
                 f"this deploy's is {digest}): {describe_diff(old, args['spec'])}; pass --recreate to replace it "
                 f"(everything running in it stops)")
    # everything the new container needs, before an old one is removed
    image = choose_image(args)
    missing = []
    for source, create, purpose in args["mounts"]:
        if os.path.exists(source):
            continue
        if create:
            os.makedirs(source, exist_ok=True)
        else:
            missing.append(f"{source} ({purpose})" if purpose else source)
    if missing:
        fail("mount sources missing: " + ", ".join(missing) + f"; {engine} would mount empty directories in their "
             "place and the container would start without them")
    if info:
        proc = engine_cmd(engine, ["rm", "-f", "-v", name])
        if proc.returncode != 0:
            fail(f"cannot remove container {name} for --recreate: {tail(proc)}")
        print(f"removed container {name} (--recreate): {describe_diff(old, args['spec'])}")
    argv = list(args["argv"])
    argv[args["image_index"]] = image
    proc = engine_cmd(engine, argv, timeout=600)
    if proc.returncode != 0:
        fail(f"{engine} run failed: {tail(proc)}")
    wait_running(engine, name)
    print(f"created container {name} from {image} (spec {digest})")


def commit(args):
    engine, name, derived, base = args["engine"], args["name"], args["derived"], args["image"]
    require_engine(engine)
    info = inspect(engine, "container", name)
    if info is None:
        fail(f"container {name} does not exist: nothing to commit")
    image_id = info.get("Image")
    have = inspect(engine, "image", derived)
    if have and (have.get("Id") == image_id or labels_of(have).get("yrpd.base-id") == image_id):
        print(f"{derived} is up to date")
        return
    changes = [f"LABEL yrpd.base-image={base}", f"LABEL yrpd.base-id={image_id}"]
    proc = engine_cmd(engine, ["commit", *[w for c in changes for w in ("--change", c)], name, derived], timeout=1800)
    if proc.returncode != 0:
        fail(f"{engine} commit {name} {derived} failed: {tail(proc)}")
    print(f"committed container {name} as {derived}")


def remove(args):
    engine, name = args["engine"], args["name"]
    require_engine(engine)
    if inspect(engine, "container", name) is None:
        print(f"no container {name} on this host")
        return
    proc = engine_cmd(engine, ["rm", "-f", "-v", name], timeout=120)
    if proc.returncode != 0:
        fail(f"cannot remove container {name}: {tail(proc)}")
    if inspect(engine, "container", name) is not None:
        fail(f"container {name} is still there after {engine} rm -f")
    print(f"removed container {name}")


if __name__ == "__main__":
    ARGS = json.loads(sys.argv[1])
    {"ensure": ensure, "commit": commit, "remove": remove}[ARGS["action"]](ARGS)
