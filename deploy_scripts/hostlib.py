"""What the host scripts share: reading /proc, and the names the controller reads back (yrpd/tags.py names the same;
tests/unit/test_tags.py checks both agree). Standard library only, like every host script.

A script takes it with one line, `from hostlib import NAME, ...`: run from the checkout (the tests) Python finds this
file beside the script; shipped to a host, yrpd.assets.deploy_script puts this file's text where that line stands,
so the script still travels as one piece.
"""
import os

#: what a supervisor (supervise.py) writes as its process's state
STARTING, RUNNING, BACKOFF, FAILED, EXITED, STOPPED = "starting", "running", "backoff", "failed", "exited", "stopped"
#: what session_processes.py adds: nothing watches it and it is gone / its supervisor was killed, it runs on
DEAD, UNSUPERVISED = "dead", "unsupervised"
STATES = (STARTING, RUNNING, BACKOFF, FAILED, EXITED, STOPPED, DEAD, UNSUPERVISED)
#: a data-system component's state in the cluster snapshot, in `yr health`'s words (the dscli launcher's
#: components say the same, from their supervisors: a supervisor state not named here is upper-cased)
UP, COMING_UP, DOWN = "RUNNING", "STARTING", "STOPPED"
COMPONENT_STATES = (UP, COMING_UP, DOWN)
#: a process in the session's status reply, key by key (yrpd.status.ProcessStatus takes them as fields)
PROCESS_KEYS = ("name", "pid", "alive", "rss_mb", "command", "supervisor", "state", "restarts", "reason", "last_log")


def shaped(keys, **values):
    """A record of a reply, refused unless it has exactly `keys`: a key renamed on one side only fails here, on the
    host, by name, instead of as a missing field on the controller."""
    if set(values) != set(keys):
        raise KeyError(f"reply record: missing {sorted(set(keys) - set(values))}, "
                       f"unexpected {sorted(set(values) - set(keys))}")
    return {k: values[k] for k in keys}


def proc_stat(pid):
    """(state letter, parent pid, process group, unix session) of a process, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1]), int(fields[2]), int(fields[3])


def proc_table():
    """(pid, state letter, parent pid, process group, unix session) of every process."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = proc_stat(entry)
            if stat:
                yield (int(entry), *stat)


def proc_alive(pid):
    """Running, sleeping or stopped; not gone and not a zombie."""
    stat = proc_stat(pid) if pid else None
    return stat is not None and stat[0] not in "ZX"


def proc_cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def proc_fd_targets(pid):
    """What the process's open file descriptors point at (paths, `socket:[inode]`, ...)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    targets = []
    for fd in fds:
        try:
            targets.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return targets


def listening_sockets():
    """Listening TCP port -> socket inode, from /proc/net/tcp and tcp6."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fh:
                lines = fh.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if cols[3] == "0A":  # LISTEN
                found.setdefault(int(cols[1].rsplit(":", 1)[1], 16), cols[9])
    return found


def proc_environ(pid):
    """The process's environment as KEY=VALUE byte strings, or None when it cannot be read (gone, or freeing its
    memory after a kill)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return fh.read().split(b"\0")
    except OSError:
        return None


def proc_rss_mb(pid):
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def host_load():
    """Load averages, memory (GB) and uptime of this host; what cannot be read is left out."""
    facts = {}
    try:
        with open("/proc/loadavg") as fh:
            facts["load"] = [float(x) for x in fh.read().split()[:3]]
        with open("/proc/meminfo") as fh:
            mem = {l.split(":")[0]: int(l.split()[1]) for l in fh if l.split(":")[0] in ("MemTotal", "MemAvailable")}
        facts["mem_total_gb"] = round(mem["MemTotal"] / 2**20, 1)
        facts["mem_available_gb"] = round(mem["MemAvailable"] / 2**20, 1)
        with open("/proc/uptime") as fh:
            facts["uptime_s"] = int(float(fh.read().split()[0]))
    except (OSError, KeyError, ValueError):
        pass
    return facts


def cpu_info():
    """(the first CPU's flags, its model name) from /proc/cpuinfo; (None, "") when unreadable."""
    flags, model = None, ""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() == "flags" and flags is None:
                    flags = set(value.split())
                elif key.strip() == "model name" and not model:
                    model = value.strip()
    except OSError:
        return None, ""
    return flags or set(), model


#: POSIX shared memory; Python's multiprocessing names its segments psm_* (vLLM's message queues among them) and its
#: named semaphores sem.mp-* (a spawned process's locks: its resource tracker unlinks them at a clean exit, a kill -9
#: of the group leaves them)
SHM_DIR = "/dev/shm/"
#: Python's multiprocessing segments and semaphores, and vLLM's CPU build's TP/PP all-reduce buffers (4 MB a rank)
SHM_SEGMENTS = (SHM_DIR + "psm_", SHM_DIR + "vllm_dist_")
SHM_PREFIX = (*SHM_SEGMENTS, SHM_DIR + "sem.mp-")


def shm_mapped(pids):
    """The psm_* and vllm_dist_* segments and sem.mp-* semaphores the processes map (unlinked ones are skipped: nothing left to
    remove). glibc maps a new semaphore under a temporary name, links it to its own and unlinks the temporary one, so
    a semaphore is found by the inode of such a mapping."""
    found, inodes = set(), set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as fh:
                for line in fh:
                    parts = line.rstrip("\n").split(maxsplit=5)
                    if len(parts) != 6:
                        continue
                    if parts[5].startswith(SHM_SEGMENTS) and not parts[5].endswith(" (deleted)"):
                        found.add(parts[5])
                    elif parts[5].startswith(SHM_DIR + "sem."):
                        inodes.add(int(parts[4]))
        except OSError:
            continue
    if inodes:
        try:
            names = [n for n in os.listdir(SHM_DIR) if n.startswith("sem.mp-")]
        except OSError:
            names = []
        for name in names:
            try:
                if os.stat(SHM_DIR + name).st_ino in inodes:
                    found.add(SHM_DIR + name)
            except OSError:
                continue
    return found


def shm_present():
    """The psm_* and vllm_dist_* segments and sem.mp-* semaphores in /dev/shm now."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return set()
    return {SHM_DIR + n for n in names if (SHM_DIR + n).startswith(SHM_PREFIX)}


def shm_held(pids):
    """The segments and semaphores (as shm_present names them) the processes map or have open: a segment is open
    before it is mapped."""
    held = shm_mapped(pids)
    for pid in pids:
        held.update(t for t in proc_fd_targets(pid) if t.startswith(SHM_PREFIX) and not t.endswith(" (deleted)"))
    return held


def unlink_unheld(segments):
    """Unlink those of the psm_* segments and sem.mp-* semaphores that no live process maps or has open (in use,
    whoever made them); the ones that are gone (removed or never there) are returned too."""
    if not segments:
        return []
    held = shm_held([pid for pid, *_ in proc_table()])
    removed = []
    for path in segments:
        if path in held or not path.startswith(SHM_PREFIX):
            continue
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            removed.append(path)  # its owner unlinked it on a clean exit
        except OSError:
            pass
    return removed


def live_stats(pattern):
    """[(path, document)] of the KV connector's stats files matching `pattern` whose writer still runs (a document
    that names no pid counts). A file outlives its process: a restart rewrites it from zero, but the file of a DP
    engine or stage that is no more (a smaller dp after a change), or one named by an older yrpd, stays, and would
    add a dead process's counters and links to the living's. A file being replaced is skipped (the next read has
    it)."""
    import glob
    import json

    found = []
    for path in sorted(glob.glob(pattern)):
        try:
            with open(path) as fh:
                doc = json.load(fh)
        except (OSError, ValueError):
            continue
        if not isinstance(doc, dict):
            continue
        pid = doc.get("pid")
        if pid is not None and not (isinstance(pid, int) and proc_alive(pid)):
            continue
        found.append((path, doc))
    return found


def ds_resource(line):
    """One line of the data system worker's resource.log (written every log_monitor_interval_ms): memory and disk-tier
    use in bytes, objects, hits by tier, misses. Fields are ' | '-separated in the order of the worker's
    res_metrics.def; ValueError for a line of another shape."""
    fields = [f.strip() for f in line.split("|")]  # the line ends with a separator too
    try:
        shm, spill = fields[7].split("/"), fields[8].split("/")
        hits = next(f for f in reversed(fields) if f.count("/") == 4 and "." not in f).split("/")
        return {"at": fields[0], "memory_used": int(shm[0]), "memory_limit": int(shm[2]),
                "disk_used": int(spill[0]), "disk_limit": int(spill[2]), "objects": int(fields[10]),
                "hits_memory": int(hits[0]), "hits_disk": int(hits[1]), "hits_remote": int(hits[3]),
                "misses": int(hits[4])}
    except (IndexError, ValueError, StopIteration):
        raise ValueError(f"unexpected resource line: ...{line[-300:]}") from None


def ds_resource_now(path, timeout_s=20.0):
    """The worker's counters as they are now (a reading between two loads of a bench or test): the second whole line
    of its resource.log written from now on, because the first may have been sampled before now and written after
    (on a busy host it was: a load counted in the next reading). RuntimeError if no such line comes in time."""
    import time

    def whole_lines():
        try:
            with open(path) as f:
                text = f.read()
        except FileNotFoundError:
            text = ""
        return text.splitlines()[:text.count("\n")]

    start = len(whole_lines())
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.25)
        lines = whole_lines()
        if len(lines) >= start + 2:
            return ds_resource(lines[start + 1])
    raise RuntimeError(f"fewer than two new lines in {path} within {timeout_s:.0f} s: is log_monitor on?")
