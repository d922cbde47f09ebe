"""The producer's writer: staged KV blocks go to the data system off the engine's critical path.

The worker half copies the blocks a step completed into staging memory (a memcpy, so vLLM may reuse them at once)
and hands them to a `Saver`, whose thread writes them in order (`exist` -> skip present keys -> `mcreate` -> copy ->
`mset_buffer` -> `exist` again, see `PendingSaves`) and deletes loaded keys for `delete_after_load`.

A write the data system answers with success is not yet a saved block. A worker whose shared memory is full of
entries it may not evict (another client's, written in the client's default write mode) takes every write without
an error, status or failed key, and evicts it within a moment, since the new blocks are all it may evict (measured on
openYuanrong 0.8.1, tests/connector/test_ds_full.py: from a tenth to two thirds of the blocks gone right after their
`mset_buffer`, the others once the writer's next job is written, or at the worker's eviction round every 10 s when no
write comes). So a block counts in `saved_blocks` once the worker still holds it after the writer's next write (or,
when none follows, at a look CONFIRM_IDLE_S later, unless the worker is evicting the writer's blocks that way); one
it does not hold counts in `save_failed_blocks` and `save_failed_memory_full_blocks`. The look is the one `exist`
call after each job's write, over that job's keys and those of the job before (`PendingSaves`).

Where the data system calls run matters: its Python client holds the GIL for the whole of each call (measured: a
1.35 s `get` on a missing key stopped every other thread of the process for 1.35 s; `mcreate`/`mset_buffer` took
30-500 ms each on the lab's loaded hosts). In the vLLM worker process that is the model's own Python, so a writer
thread there stalls the forward of the next step for as long as each save takes. `ProcessSaver` (the default on
the host path, `kv_connector_extra_config.saver: process`) therefore runs those calls in a child process of its
own (`python -m yrpd.connector.saver`): the staging slabs are memfd shared memory the child maps through
/proc/<worker>/fd, each job crosses a pipe as a few hundred bytes, and the worker's thread only waits on that pipe,
which releases the GIL. The child leaves the worker's CPU pinning (it is I/O, not compute), dies with the worker
(PDEATHSIG, and EOF on its pipe), and is started again on the next job when it dies (its jobs meanwhile fail and are
counted). `saver: thread` keeps the calls in the worker process (tests with an in-process stand-in data system).
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import pickle
import queue
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Sequence

from yrpd.connector.config import ConnectorConfig, parse_config
from yrpd.connector.stats import ConnectorStats
from yrpd.connector.transport import (
    DsConnection,
    HostTransport,
    StagingPool,
    TransportError,
    kv_connection,
    memory_full,
    value_nbytes,
    values_from_staged,
    write_mode,
)

logger = logging.getLogger("yrpd.connector")

RESTART_BACKOFF_S = 5.0  # a child that died is started again at most this often
CONFIRM_IDLE_S = 1.0  # a writer idle this long looks whether the worker still holds its last job's blocks
FAILED_SAVE_LOG_S = 60.0  # failed saves are logged at WARNING at most this often (each one at DEBUG)
_HEADER = struct.Struct("<I")


class Job:
    __slots__ = ("kind", "keys", "data", "nbytes", "done", "req_id", "slab")

    def __init__(self, kind: str, keys: list, data: Any = None, nbytes: int = 0, req_id: str = "") -> None:
        self.kind = kind
        self.keys = keys
        self.data = data
        self.nbytes = nbytes
        self.req_id = req_id
        self.slab = None
        self.done = threading.Event()


class PendingSaves:
    """A writer's blocks that the worker held right after their write and that are not counted yet.

    They count as saved once the worker still holds them after the writer's next write, or at a look when no write
    follows (`confirm`); as failed, for want of memory, when it no longer does. `evicting`: the last look found some
    of the writer's fresh blocks gone, as a worker full of entries it may not evict does with each one at the next
    write: until a look finds them all held again, an idle look does not count them (only the next write tells)."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.nbytes: list[int] = []
        self.evicting = False

    def __len__(self) -> int:
        return len(self.keys)

    def answer(self) -> dict:
        return {"pending": len(self.keys), "pending_bytes": sum(self.nbytes), "evicting": self.evicting}


def _outcome(skipped: int = 0) -> dict:
    """A writer's answer for one job or look: blocks saved (bytes), skipped (already there), failed and why."""
    return {"saved": 0, "bytes": 0, "skipped": skipped, "failed": 0, "failed_memory_full": 0, "reason": ""}


def _evicted(out: dict, gone: int, when: str) -> None:
    if gone:
        out["failed"] += gone
        out["failed_memory_full"] += gone
        out["reason"] = (f"the data system evicted {gone} block(s) it had taken without error {when} (out of memory: "
                         f"its memory is full of entries it may not evict)")


def _settle(out: dict, pending: PendingSaves, held: Sequence[bool], when: str) -> None:
    """Count the pending blocks into `out` by `held` (whether the worker holds each), and forget them."""
    out["saved"] += sum(held)
    out["bytes"] += sum(n for n, there in zip(pending.nbytes, held) if there)
    _evicted(out, len(held) - sum(held), when)
    pending.keys, pending.nbytes = [], []


def write_job(transport: HostTransport, ttl_seconds: int, keys: Sequence[str], values: Sequence[Any],
              pending: PendingSaves | None = None) -> dict:
    """Save `values[i]` under `keys[i]` unless the key exists (then only its TTL is refreshed: a hot prefix stays).

    With `pending` (the writer's PendingSaves), one `exist` after the write looks at this job's keys and the pending
    ones: pending blocks still held are saved, gone ones failed; this job's blocks gone already are failed, the held
    ones become the pending ones. Without it, what the data system took without error counts as saved (no look).
    Returns {"saved", "bytes", "skipped", "failed", "failed_memory_full", "reason"} plus, with `pending`, its
    `answer()`; raises TransportError/KeyError when the data system fails the job (the pending blocks stay pending)."""
    present = transport.exists(keys)
    missing = [i for i, there in enumerate(present) if not there]
    existing = [k for k, there in zip(keys, present) if there]
    if existing and ttl_seconds > 0:
        try:
            transport.expire(existing, ttl_seconds)
        except (TransportError, KeyError):
            pass
    out = _outcome(len(keys) - len(missing))
    new = [keys[i] for i in missing]
    if pending is not None and not set(new).isdisjoint(pending.keys):
        # a pending block written again (the same block of another request): it was gone before this write
        again = [k in set(new) for k in pending.keys]
        _evicted(out, sum(again), "before it was written again")
        pending.keys = [k for k, a in zip(pending.keys, again) if not a]
        pending.nbytes = [n for n, a in zip(pending.nbytes, again) if not a]
    written = transport.save(new, [values[i] for i in missing], ttl_seconds) if missing else 0
    if pending is None:
        out.update(saved=len(new), bytes=written)
        return out
    if not new:
        return {**out, **pending.answer()}
    try:
        held = transport.held(pending.keys + new)
    except TransportError as e:  # the look failed, not the write: the data system took them without error
        logger.debug("yrpd connector: cannot look whether the worker holds the blocks just written: %s", e)
        held = [True] * (len(pending) + len(new))
    _settle(out, pending, held[:len(pending.keys)], "once the writer's next blocks were written")
    fresh = held[len(held) - len(new):]
    _evicted(out, fresh.count(False), "right after their write")
    pending.keys = [k for k, there in zip(new, fresh) if there]
    pending.nbytes = [value_nbytes(values[i]) for i, there in zip(missing, fresh) if there]
    pending.evicting = out["failed"] > 0
    return {**out, **pending.answer()}


def confirm_pending(transport: HostTransport, pending: PendingSaves, force: bool = False) -> dict:
    """The idle look at the pending blocks: held ones saved, gone ones failed. Skipped while the worker evicts the
    writer's blocks at each next write (`pending.evicting`) unless `force` (flush, stop)."""
    out = _outcome()
    if pending and (force or not pending.evicting):
        try:
            held = transport.held(pending.keys)
        except TransportError as e:  # the data system took them without error; it cannot say more now
            logger.debug("yrpd connector: cannot look whether the worker holds the pending blocks: %s", e)
            held = [True] * len(pending)
        _settle(out, pending, held, "while the writer was idle")
        pending.evicting = out["failed"] > 0
    return {**out, **pending.answer()}


class Saver:
    """A thread that writes staged blocks (and deletes keys) in submission order, with its own data-system
    connection in this process."""

    def __init__(self, conn: DsConnection | None, cfg: ConnectorConfig, stats: ConnectorStats,
                 max_pending_bytes: int, pool: StagingPool | None = None) -> None:
        self.pool = pool
        self.conn = conn
        self.transport = HostTransport(conn, cfg.max_batch_keys, write_mode=write_mode(cfg)) if conn else None
        self.cfg = cfg
        self.stats = stats
        self.max_pending_bytes = max_pending_bytes
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="yrpd-kv-saver", daemon=True)
        self._started = False
        # blocks written but not counted yet: the PendingSaves where the writes run (this thread's; a ProcessSaver's
        # child has its own) and what the writer's last answer said of them. With delete_after_load a consumer may
        # delete what it loaded before the next write looks: no looks then
        self._unconfirmed: PendingSaves | None = None if cfg.delete_after_load else PendingSaves()
        self._unconfirmed_n = 0
        self._unconfirmed_bytes = 0
        self._evicting = False
        self._failed_unlogged = 0  # failed blocks since the last WARNING about them
        self._failed_logged_at = -1e9

    def start(self) -> None:
        if not self._started:
            self._started = True
            self._thread.start()

    def submit(self, job: Job) -> bool:
        with self._lock:
            if job.nbytes and self._pending_bytes + job.nbytes > self.max_pending_bytes:
                return False
            self._pending_bytes += job.nbytes
        self._q.put(job)
        return True

    def flush(self, timeout_s: float) -> bool:
        marker = Job("flush", [])
        self._q.put(marker)
        return marker.done.wait(timeout_s)

    def stop(self, timeout_s: float = 5.0) -> None:
        if self._started:
            self.flush(timeout_s)
            self._q.put(None)
            self._thread.join(timeout_s)
        self._close()

    def _open(self) -> None:
        self.conn.connect()

    def _close(self) -> None:
        self.conn.close()

    def _run(self) -> None:
        self._open()
        while True:
            idle_look = self._unconfirmed_n and not self._evicting
            try:
                job = self._q.get(timeout=CONFIRM_IDLE_S if idle_look else None)
            except queue.Empty:
                self._confirm(force=False)
                continue
            if job is None:
                return
            try:
                if job.kind == "save":
                    self._save(job)
                elif job.kind == "delete":
                    self._delete(job)
                elif job.kind == "flush" and self._unconfirmed_n:
                    self._confirm(force=True)  # what a flush waits for is counted when it returns
            except Exception as e:  # noqa: BLE001 - never let the saver die
                logger.warning("yrpd connector: %s job failed: %s", job.kind, e)
            finally:
                with self._lock:
                    self._pending_bytes -= job.nbytes
                job.data = None
                if job.slab is not None and self.pool is not None:
                    self.pool.release(job.slab)
                    job.slab = None
                job.done.set()

    def _count_save(self, n: int, result: dict | None, ms: float, error: str = "") -> None:
        """Count a job of `n` blocks, or a look at the pending ones (`n` 0, `ms` None): `result` is the writer's
        answer, None when the job failed (`error`: why)."""
        if result is None:
            self.stats.inc("ds_errors")
            self._count_failed(n, n if memory_full(error) else 0, error)
            return
        self.stats.inc("saved_blocks", result["saved"])
        self.stats.inc("saved_bytes", result["bytes"])
        self.stats.inc("save_skipped_existing", result["skipped"])
        if ms is not None:
            self.stats.observe("save", ms)
        if result.get("failed"):
            self._count_failed(result["failed"], result.get("failed_memory_full", 0), result.get("reason", ""))
        if "pending" in result:
            self._unconfirmed_n, self._unconfirmed_bytes = result["pending"], result["pending_bytes"]
            self._evicting = result["evicting"]

    def _count_failed(self, failed: int, full: int, reason: str) -> None:
        """Blocks not in the data system: save_failed_blocks, and save_failed_memory_full_blocks for those its
        worker had no room for (what `yrpd status` names); logged at WARNING at most every FAILED_SAVE_LOG_S."""
        self.stats.inc("save_failed_blocks", failed)
        self.stats.inc("save_failed_memory_full_blocks", full)
        logger.debug("yrpd connector: %d block(s) not saved: %s", failed, reason)
        self._failed_unlogged += failed
        now = time.monotonic()
        if now - self._failed_logged_at >= FAILED_SAVE_LOG_S:
            logger.warning("yrpd connector: %d KV block(s) not saved to the data system since the last such warning "
                           "(save_failed_blocks; what would have loaded them computes them again); the last: %s",
                           self._failed_unlogged, reason[:300])
            self._failed_unlogged, self._failed_logged_at = 0, now

    def _save(self, job: Job) -> None:
        t0 = time.perf_counter()
        try:
            result = write_job(self.transport, self.cfg.ttl_seconds, job.keys,
                               values_from_staged(job.data, range(len(job.keys))), self._unconfirmed)
        except (TransportError, KeyError) as e:
            self._count_save(len(job.keys), None, 0.0, str(e))
            return
        self._count_save(len(job.keys), result, (time.perf_counter() - t0) * 1000.0)

    def _confirm(self, force: bool) -> None:
        """Look whether the worker still holds the pending blocks, and count them."""
        if self._unconfirmed is not None:
            self._count_save(0, confirm_pending(self.transport, self._unconfirmed, force), None)

    def _delete(self, job: Job) -> None:
        try:
            self.transport.delete(job.keys)
            self.stats.inc("deleted_blocks", len(job.keys))
        except (TransportError, KeyError) as e:
            self.stats.inc("ds_errors")
            logger.debug("yrpd connector: delete failed: %s", e)


# ---------------------------------------------------------------------------------------------
# Shared staging memory
# ---------------------------------------------------------------------------------------------

class SharedSlab:
    """A staging slab in memfd shared memory: per part a (capacity, bytes per block) uint8 tensor, one part after
    the other, so the writer process reads row i of part k at `offsets[k] + i * part_nbytes[k]`.

    The writer maps each slab once, by its id (fd numbers are reused once a dropped slab closes its fd)."""

    _ids = iter(range(1, 1 << 62))

    def __init__(self, capacity: int, part_nbytes: Sequence[int]) -> None:
        import torch

        self.id = next(SharedSlab._ids)
        self.capacity = capacity
        self.part_nbytes = [int(x) for x in part_nbytes]
        size = capacity * sum(self.part_nbytes)
        self.fd = os.memfd_create("yrpd-kv-staging", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, size)
        self._mm = mmap.mmap(self.fd, size)
        flat = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.offsets, self._parts, off = [], [], 0
        for nb in self.part_nbytes:
            self.offsets.append(off)
            self._parts.append(flat[off:off + capacity * nb].view(capacity, nb))
            off += capacity * nb

    def __getitem__(self, k: int):
        return self._parts[k]

    def __len__(self) -> int:
        return len(self._parts)

    def describe(self) -> dict:
        return {"id": self.id, "pid": os.getpid(), "fd": self.fd, "capacity": self.capacity,
                "parts": self.part_nbytes, "offsets": self.offsets}

    def __del__(self) -> None:
        # the pool dropped it (it only drops free slabs); the mapping goes with the last tensor viewing it
        try:
            os.close(self.fd)
        except (OSError, AttributeError):
            pass


def shared_slab_factory(capacity: int, part_nbytes: Sequence[int]) -> SharedSlab:
    return SharedSlab(capacity, part_nbytes)


# ---------------------------------------------------------------------------------------------
# The writer process
# ---------------------------------------------------------------------------------------------

def _send(stream, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:  # the worker's end is unbuffered: a write a signal interrupts may take only part of it
        view = view[stream.write(view):]
    stream.flush()


class AnswerTimeout(Exception):
    pass


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    """n bytes from a pipe's raw fd by a monotonic deadline (a hung child must not hold the worker's thread);
    `deadline` None: as long as it takes (the child waiting for its next job)."""
    got = bytearray()
    while len(got) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise AnswerTimeout(f"no answer within the deadline ({len(got)} of {n} bytes)")
        chunk = os.read(fd, n - len(got))
        if not chunk:
            raise EOFError("the other side closed the pipe")
        got += chunk
    return bytes(got)


def _recv(fd: int, deadline: float | None = None) -> Any:
    (size,) = _HEADER.unpack(_read_exact(fd, _HEADER.size, deadline))
    return pickle.loads(_read_exact(fd, size, deadline))


class ProcessSaver(Saver):
    """A Saver whose data-system calls run in a child process (see the module docstring)."""

    def __init__(self, role: str, extra_config: dict, cfg: ConnectorConfig, stats: ConnectorStats,
                 max_pending_bytes: int, pool: StagingPool, on_event: Callable[[str], None] | None = None,
                 command: Sequence[str] | None = None) -> None:
        super().__init__(None, cfg, stats, max_pending_bytes, pool)
        self._argv = list(command or [sys.executable, "-m", "yrpd.connector.saver"]) + \
            [role, json.dumps(extra_config, default=str)]
        self._on_event = on_event or (lambda _e: None)
        self._proc: subprocess.Popen | None = None
        self._started_at = -1e9
        self._stopping = False
        self.deaths = 0

    # -- the child -------------------------------------------------------------------------------
    def _open(self) -> None:
        self._spawn()

    def _spawn(self) -> bool:
        now = time.monotonic()
        if self._stopping or now - self._started_at < RESTART_BACKOFF_S:
            return False
        self._started_at = now
        env = dict(os.environ)
        # the package this code came from, wherever the worker found it (PYTHONPATH, a bundle, site-packages)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        try:
            # unbuffered: answers are read from the raw fd under a deadline
            self._proc = subprocess.Popen(self._argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None,
                                          close_fds=True, env=env, bufsize=0)
        except OSError as e:
            self._proc = None
            logger.error("yrpd connector: cannot start the writer process (%s); saves are dropped until it starts", e)
            return False
        return True

    @property
    def child_pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def _close(self) -> None:
        self._stopping = True  # stop() ends here: a thread that outlived its join must not start another child
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()  # the child drains nothing more and exits on EOF
        except OSError:
            pass
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

    def answer_deadline_s(self, n_keys: int) -> float:
        """How long a job may take in the child: a reconnect, then per batch of keys at most five data-system
        calls (exist, expire, mcreate, mset_buffer, and the look after the write, whose keys may fill one more
        batch) that each end by the request timeout, and slack for a loaded host. Past it the child is taken for
        hung."""
        batches = max(1, -(-n_keys // self.cfg.max_batch_keys))
        return (self.cfg.connect_timeout_ms + (5 * batches + 1) * self.cfg.request_timeout_ms) / 1000.0 + 10.0

    def _call(self, request: dict) -> dict | None:
        """One request to the child and its answer; None (logged, once per failure) when it is gone, hung or out of
        step: that child is killed, so the next job starts a new one and the slab is free to reuse."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            if proc is not None:
                self._child_died(proc)
            if not self._spawn():
                return None
            proc = self._proc
        deadline = time.monotonic() + self.answer_deadline_s(len(request.get("keys", ())))
        try:
            _send(proc.stdin, request)
            return _recv(proc.stdout.fileno(), deadline)
        except Exception as e:  # noqa: BLE001 - whatever broke the exchange, the pipe is out of step now
            self._child_died(proc, f"{type(e).__name__}: {e}")
            return None

    def _child_died(self, proc: subprocess.Popen, why: str = "") -> None:
        code = proc.poll()
        if code is None:
            proc.kill()
            code = proc.wait()
        if self._proc is proc:
            self._proc = None
        for pipe in (proc.stdin, proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass
        self.deaths += 1
        self.stats.inc("ds_errors")
        if self._unconfirmed_n:  # its pending blocks were held at their last look; nothing can look at them now
            self.stats.inc("saved_blocks", self._unconfirmed_n)
            self.stats.inc("saved_bytes", self._unconfirmed_bytes)
            self._unconfirmed_n, self._unconfirmed_bytes, self._evicting = 0, 0, False
        logger.error("yrpd connector: the writer process %d ended (exit %s%s); its saves fail until it is started "
                     "again (within %.0f s)", proc.pid, code, f": {why}" if why else "", RESTART_BACKOFF_S)

    # -- jobs ------------------------------------------------------------------------------------
    def _save(self, job: Job) -> None:
        slab = job.slab
        answer = self._call({"op": "save", "keys": job.keys, "slab": slab.describe(), "ttl": self.cfg.ttl_seconds})
        for event in (answer or {}).get("events", ()):
            self._on_event(event)
        if answer is None or answer.get("error"):
            self._count_save(len(job.keys), None, 0.0, (answer or {}).get("error", "writer process gone"))
            return
        self._count_save(len(job.keys), answer, answer["ms"])

    def _confirm(self, force: bool) -> None:
        answer = self._call({"op": "confirm", "force": force})
        for event in (answer or {}).get("events", ()):
            self._on_event(event)
        if answer is not None and not answer.get("error"):
            self._count_save(0, answer, None)

    def _delete(self, job: Job) -> None:
        answer = self._call({"op": "delete", "keys": job.keys})
        for event in (answer or {}).get("events", ()):
            self._on_event(event)
        if answer is None or answer.get("error"):
            self.stats.inc("ds_errors")
            return
        self.stats.inc("deleted_blocks", len(job.keys))


def _die_with_parent() -> None:
    try:
        import ctypes

        # KILL: it holds nothing to clean up, and a TERM the worker ignores would be ignored here too
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: EOF on stdin still ends it


def _unpin() -> None:
    """Run on any of the host's CPUs: the worker's pinning to its compute cores is inherited, and this is I/O."""
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except (OSError, AttributeError):
        pass


class _SlabViews:
    """The writer's maps of the worker's staging slabs, opened once each through /proc/<pid>/fd/<fd>.

    A map is dropped as soon as the worker has dropped its slab (the fd is closed, or its number now names another
    file): the child's map would otherwise keep the pages of memory the worker's staging budget no longer counts.
    Beyond `keep` live slabs the least recently used are unmapped too."""

    def __init__(self, keep: int = 64) -> None:
        self._maps: dict = {}  # slab id -> (path, inode, view)
        self.keep = keep

    def __len__(self) -> int:
        return len(self._maps)

    def prune(self) -> None:
        for key, (path, inode, _) in list(self._maps.items()):
            try:
                alive = os.stat(path).st_ino == inode
            except OSError:
                alive = False
            if not alive:
                del self._maps[key]  # unmapped once no view of it is left

    def values(self, slab: dict, n: int) -> list:
        self.prune()
        key = slab["id"]
        entry = self._maps.pop(key, None)
        if entry is None:
            size = slab["capacity"] * sum(slab["parts"])
            path = f"/proc/{slab['pid']}/fd/{slab['fd']}"
            with open(path, "rb") as f:
                entry = (path, os.fstat(f.fileno()).st_ino, memoryview(mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)))
            while len(self._maps) >= self.keep:
                del self._maps[next(iter(self._maps))]
        self._maps[key] = entry
        mv = entry[2]
        return [[mv[off + i * nb: off + (i + 1) * nb] for off, nb in zip(slab["offsets"], slab["parts"])]
                for i in range(n)]


def child_main(argv: Sequence[str]) -> int:
    """`python -m yrpd.connector.saver ROLE EXTRA_CONFIG_JSON`: serve save/delete requests on stdin until EOF."""
    # answers get fd 1 to themselves: whatever else writes to stdout (a native library, an import) goes to stderr
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    _die_with_parent()
    _unpin()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s (writer %(process)d): %(message)s")
    role, extra = argv[0], json.loads(argv[1])
    cfg = parse_config(role, extra)
    if cfg.writer_nice:
        os.nice(cfg.writer_nice)  # from the worker's own niceness, which the child inherited
    events: list = []
    conn = kv_connection(cfg, "writer", events.append)
    conn.connect()
    transport = HostTransport(conn, cfg.max_batch_keys, write_mode=write_mode(cfg))
    pending = None if cfg.delete_after_load else PendingSaves()  # as Saver._unconfirmed
    slabs = _SlabViews()
    stdin = sys.stdin.fileno()
    while True:
        try:
            request = _recv(stdin)
        except EOFError:
            conn.close()
            return 0
        t0 = time.perf_counter()
        answer: dict = {}
        try:
            if request["op"] == "save":
                answer = write_job(transport, int(request["ttl"]), request["keys"],
                                   slabs.values(request["slab"], len(request["keys"])), pending)
            elif request["op"] == "confirm":
                answer = confirm_pending(transport, pending, bool(request.get("force"))) if pending is not None \
                    else _outcome()
            elif request["op"] == "delete":
                transport.delete(request["keys"])
            else:
                answer = {"error": f"unknown request {request['op']!r}"}
        except (TransportError, KeyError) as e:
            answer = {"error": str(e)[:300]}
        except Exception as e:  # noqa: BLE001 - a bad request must not end the writer
            logger.exception("yrpd connector: writer request failed")
            answer = {"error": f"{type(e).__name__}: {e}"[:300]}
        answer["ms"] = (time.perf_counter() - t0) * 1000.0
        answer["events"], events[:] = list(events), []
        _send(answers, answer)


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
