"""Moving whole KV blocks in and out of the openYuanrong data system.

One small interface, two implementations:

* `HostTransport` - `yr.datasystem.KVClient`: batched `mcreate` + copy into the shared-memory
  buffers + `mset_buffer` to save, zero-copy `get_read_only_buffers` + one copy into the paged
  KV cache to load. Used for CPU KV caches (and as the staging path for accelerator tensors).
* `NpuTransport` - the data system's device client (`HeteroClient`, which `DsTensorClient`
  wraps): `mset_d2h` / `mget_h2d` with one `DeviceBlobList` per key, whose blobs are the block's
  slices of every layer's K/V cache on the NPU. Needs Ascend + CANN; only the argument building
  (`device_blob_lists`) runs elsewhere.

A stored value is the concatenation, in a fixed order (layers sorted by index, then K/V parts),
of the raw bytes of one block of every part: a bit-exact copy of whole blocks, whatever the
layout inside a block (on CPU: K transposed inside each (block, head) tile, then V).

`DsConnection` wraps a client with failure handling: connection-level errors (worker gone,
timeouts) mark the data system down; while down, callers skip it (lookups miss, saves are
dropped, loads fail fast -> recompute) and a background thread reconnects after a backoff.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

logger = logging.getLogger("yrpd.connector")

# Substrings of data-system status messages that mean "the key is not there" (a miss, not a fault).
_MISS_MARKERS = ("key not found", "not exist", "k_not_found", "object not found")
# ... and those that mean the connection/worker is unusable.
_DOWN_MARKERS = ("rpc unavailable", "uds_connect_failed", "timeout", "timed out", "try again",
                 "connection", "not responded", "rpc_recv", "disconnect", "client is not init",
                 "shutdown")
# ... and those of a worker whose shared memory has no room for a write ("code: [Out of memory], msg: [Shared memory
# no space in arena: 9 ...]" from mcreate or mset_buffer).
_FULL_MARKERS = ("out of memory", "out_of_memory", "no space")


class TransportError(RuntimeError):
    """A data-system operation failed (the caller falls back: miss / drop / recompute)."""


class DsUnavailable(TransportError):
    """The data system is (currently) unreachable."""


def memory_full(text: str) -> bool:
    """Whether a data-system error's text says the worker's memory has no room for the write."""
    text = text.lower()
    return any(m in text for m in _FULL_MARKERS)


def classify_error(exc: BaseException) -> str:
    """'miss' | 'down' | 'error' for an exception raised by a data-system client."""
    text = str(exc).lower()
    if any(m in text for m in _MISS_MARKERS):
        return "miss"
    if any(m in text for m in _DOWN_MARKERS):
        return "down"
    return "error"


@dataclass(frozen=True)
class BlockLayout:
    """Where the bytes of one block live: `parts` are per-layer (or per-layer-K/V) cache tensors
    indexed by block id on dim 0; a stored value is the concatenation of part[block] over parts."""

    part_nbytes: tuple  # bytes of one block of each part
    offsets: tuple  # byte offset of each part inside a stored value

    @property
    def block_nbytes(self) -> int:
        return sum(self.part_nbytes)

    @classmethod
    def from_sizes(cls, sizes: Sequence[int]) -> "BlockLayout":
        offs, o = [], 0
        for s in sizes:
            offs.append(o)
            o += int(s)
        return cls(tuple(int(s) for s in sizes), tuple(offs))


def split_kv_parts(kv_cache: Any, num_blocks: int | None = None) -> list:
    """Normalise one layer's KV cache into tensors indexed by block on dim 0.

    Accepts the layouts vLLM backends use: one tensor (num_blocks, ...) (CPU:
    (num_blocks, kv_heads, block_size, 2*head_size)); one tensor (2, num_blocks, ...) (K and V
    stacked in front); or a tuple/list of per-K/V tensors (num_blocks, ...) (vllm-ascend).
    """
    if isinstance(kv_cache, (list, tuple)):
        out = []
        for t in kv_cache:
            out.extend(split_kv_parts(t, num_blocks))
        return out
    shape = tuple(kv_cache.shape)
    if num_blocks is not None and len(shape) >= 2 and shape[0] == 2 and shape[1] == num_blocks \
            and shape[0] != num_blocks:
        return [kv_cache[0], kv_cache[1]]
    return [kv_cache]


def part_block_nbytes(part: Any) -> int:
    n = 1
    for d in tuple(part.shape)[1:]:
        n *= int(d)
    return n * part.element_size()


def check_block_contiguous(part: Any) -> bool:
    """Each block slice part[b] must be one contiguous range of memory."""
    return bool(part[0].is_contiguous()) if part.shape[0] > 0 else True


# ---------------------------------------------------------------------------------------------
# NPU argument building (pure, unit-tested on CPU tensors)
# ---------------------------------------------------------------------------------------------

def block_blobs(parts: Sequence[Any], block_id: int) -> list[tuple[int, int]]:
    """(address, nbytes) of block `block_id` in every part, in value order."""
    out = []
    for p in parts:
        if not (0 <= block_id < p.shape[0]):
            raise IndexError(f"block {block_id} out of range for a cache of {p.shape[0]} blocks")
        stride_bytes = p.stride(0) * p.element_size()
        out.append((p.data_ptr() + block_id * stride_bytes, part_block_nbytes(p)))
    return out


def device_blob_lists(parts: Sequence[Any], block_ids: Sequence[int], device_id: int,
                      blob_cls: Callable, dbl_cls: Callable) -> list:
    """One DeviceBlobList per block for HeteroClient.mset_d2h / mget_h2d.

    blob_cls(dev_ptr, size) and dbl_cls(dev_idx, blob_list) are the data system's `Blob` and
    `DeviceBlobList` (injected so this runs and is tested without the NPU runtime).
    """
    if device_id is None or device_id < 0:
        raise ValueError("device_id must be a non-negative device index")
    lists = []
    for b in block_ids:
        lists.append(dbl_cls(int(device_id), [blob_cls(ptr, size) for ptr, size in block_blobs(parts, b)]))
    return lists


def write_mode(cfg: Any) -> Any:
    """The data system's write mode for saved blocks (`cfg`: a ConnectorConfig): evictable unless the config says
    otherwise (a full worker then drops old blocks instead of failing new saves; vllm-ascend's own yuanrong backend
    writes the same way)."""
    if not cfg.evictable:
        return None
    try:
        from yr.datasystem.kv_client import WriteMode
    except ImportError:  # pragma: no cover - a client without write modes: its default
        return None
    return getattr(WriteMode, "NONE_L2_CACHE_EVICT", None)


def set_param_for(ttl_seconds: int, set_param_cls: Callable, write_mode: Any = None):
    sp = set_param_cls()
    sp.ttl_second = int(ttl_seconds)
    if write_mode is not None:
        sp.write_mode = write_mode
    return sp


# ---------------------------------------------------------------------------------------------
# Connection with failure handling
# ---------------------------------------------------------------------------------------------

#: while a data-system worker is unreachable, how often its port is tried (a TCP connect, nothing sent), and how often
#: a new client is tried while the port accepts (without an address to watch: `backoff_s` between tries)
PROBE_S = 0.2
RETRY_S = 0.5
#: the timeouts of the client tried first while reconnecting (DsConnection's quick_factory)
QUICK_TIMEOUT_MS = 500


def _accepts(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=PROBE_S).close()
    except OSError:
        return False
    return True


class DsConnection:
    """A data-system client plus health state. Not thread-safe: use one per thread."""

    def __init__(self, factory: Callable[[], Any], name: str, backoff_s: float = 5.0,
                 on_event: Callable[[str], None] | None = None, address: tuple[str, int] | None = None,
                 quick_factory: Callable[[], Any] | None = None) -> None:
        self._factory = factory
        #: a client with short timeouts, made first on each try while down: a worker that is not ready yet turns it
        #: away within a second, where the real client's init would wait out its own timeout (5 s) each time
        self._quick_factory = quick_factory
        self.name = name
        self.backoff_s = backoff_s
        #: the worker's (host, port): while down, a TCP connect there every PROBE_S tells when it answers again, and
        #: the first new client is made then, and every RETRY_S while it accepts (a restarted worker is used about
        #: half a second after it serves); `backoff_s` spaces the tries where the port never accepts or there is none
        #: to watch
        self.address = address
        self._on_event = on_event or (lambda _e: None)
        self._client: Any = None
        self._down_since: float | None = None
        self._last_error = ""
        self._lock = threading.Lock()
        self._reconnecting = False
        self._closed = False

    # -- state --------------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self._client is not None and self._down_since is None

    @property
    def last_error(self) -> str:
        return self._last_error

    def connect(self) -> bool:
        """Synchronous first connect (at startup). On failure, reconnects in the background."""
        try:
            client = self._factory()
        except Exception as e:  # noqa: BLE001 - any client failure means "not connected"
            self._mark_down(e)
            return False
        self._client = client
        self._down_since = None
        return True

    def _mark_down(self, exc: BaseException) -> None:
        self._last_error = str(exc)[:300]
        first = self._down_since is None
        self._down_since = time.monotonic()
        if first:
            logger.warning("yrpd connector: data system %s unavailable (%s); falling back to recompute, "
                           "retrying every %.1fs", self.name, self._last_error, self.backoff_s)
            self._on_event("down")
        self._start_reconnect()

    def _start_reconnect(self) -> None:
        with self._lock:
            if self._reconnecting or self._closed:
                return
            self._reconnecting = True
        threading.Thread(target=self._reconnect_loop, name=f"yrpd-ds-reconnect-{self.name}", daemon=True).start()

    def _reconnect_loop(self) -> None:
        tried = time.monotonic()
        # the worker's port as of the last probe: unknown at first, so that a port that accepts is tried at once (a
        # client left stale by a worker that restarted before anything was asked of it), then once it opens again
        answered = False
        try:
            while not self._closed:
                time.sleep(PROBE_S if self.address else self.backoff_s)
                if self._closed:
                    return
                if self.address:
                    # a port that accepts again (a restarted worker) is tried at once, then every RETRY_S while it
                    # accepts and clients fail (a restarted worker listens some seconds before it serves: "Worker
                    # not ready"); one that never accepts (a worker reached otherwise) every backoff_s
                    was, answered = answered, _accepts(*self.address)
                    waited = time.monotonic() - tried
                    if not (answered and (not was or waited >= RETRY_S)) and waited < self.backoff_s:
                        continue
                tried = time.monotonic()
                try:
                    if self._quick_factory is not None:
                        self._quick_factory()
                    client = self._factory()
                    status = client.health_check() if hasattr(client, "health_check") else None
                    if status is not None and hasattr(status, "is_ok") and not status.is_ok():
                        raise DsUnavailable(status.to_string() if hasattr(status, "to_string") else "unhealthy")
                except Exception as e:  # noqa: BLE001
                    self._last_error = str(e)[:300]
                    continue
                self._client = client
                self._down_since = None
                logger.info("yrpd connector: data system %s reachable again", self.name)
                self._on_event("up")
                return
        finally:
            with self._lock:
                self._reconnecting = False

    def call(self, op: str, fn: Callable[[Any], Any]) -> Any:
        """Run fn(client). Raises DsUnavailable when down (fast) and TransportError on failure;
        connection-level failures mark the connection down."""
        client = self._client
        if client is None or self._down_since is not None:
            raise DsUnavailable(f"data system {self.name} unavailable: {self._last_error}")
        try:
            return fn(client)
        except Exception as e:  # noqa: BLE001
            kind = classify_error(e)
            if kind == "down":
                self._mark_down(e)
                raise DsUnavailable(f"{op}: {e}") from e
            if kind == "miss":
                raise KeyError(str(e)) from e
            self._on_event("error")
            raise TransportError(f"{op}: {e}") from e

    def close(self) -> None:
        self._closed = True
        self._client = None


# ---------------------------------------------------------------------------------------------
# Transports
# ---------------------------------------------------------------------------------------------

class Transport:
    """Interface. keys[i] names the value made of block block_ids[i] of every part."""

    def exists(self, keys: Sequence[str]) -> list[bool]:
        raise NotImplementedError

    def save(self, keys: Sequence[str], values: Any, ttl_seconds: int) -> int:
        """Store values[i] (bytes-like, block_nbytes each) under keys[i]; returns bytes written."""
        raise NotImplementedError

    def load(self, keys: Sequence[str], parts: Sequence[Any], layout: BlockLayout,
             block_ids: Sequence[int]) -> list[bool]:
        """Copy the stored value of keys[i] into block block_ids[i] of every part; per-key success."""
        raise NotImplementedError

    def delete(self, keys: Sequence[str]) -> None:
        raise NotImplementedError

    def expire(self, keys: Sequence[str], ttl_seconds: int) -> None:
        raise NotImplementedError


def _memmove(dst_ptr: int, src_ptr: int, nbytes: int) -> None:
    """Raw copy between CPU addresses (no per-call tensor overhead; releases the GIL)."""
    import ctypes

    ctypes.memmove(dst_ptr, src_ptr, nbytes)


def _cpu_contiguous_blocks(parts: Sequence[Any]) -> bool:
    return all(getattr(p, "device", None) is not None and p.device.type == "cpu" and p[0].is_contiguous()
               for p in parts)


def _u8(t: Any):
    import torch

    return t.reshape(-1).view(torch.uint8) if t.dtype != torch.uint8 else t.reshape(-1)


def block_rows_u8(part: Any):
    """(num_blocks, bytes_per_block) uint8 view of a part, or None if the part is not contiguous."""
    import torch

    if not part.is_contiguous():
        return None
    rows = part.view(part.shape[0], -1)
    return rows if rows.dtype == torch.uint8 else rows.view(torch.uint8)


def _private_slab(capacity: int, part_nbytes: Sequence[int]) -> list:
    import torch

    return [torch.empty((capacity, nb), dtype=torch.uint8) for nb in part_nbytes]


class StagingPool:
    """Reusable host staging buffers (fresh multi-MB allocations cost a page fault per 4 KiB).

    A slab holds, per part, a (capacity, bytes_per_block) uint8 tensor. `acquire(n)` hands out a
    free slab with capacity >= n (allocating one while the pool stays under `max_bytes`), or None
    when the pool is exhausted; `release` returns it once the saver has written it.
    """

    def __init__(self, part_nbytes: Sequence[int], max_bytes: int,
                 slab_factory: Callable[[int, Sequence[int]], Any] | None = None) -> None:
        """`slab_factory(capacity, part_nbytes)`: the per-part tensors of a new slab (default: private memory;
        `saver.SharedSlab` puts them in shared memory a writer process can read)."""
        self.part_nbytes = [int(x) for x in part_nbytes]
        self.max_bytes = int(max_bytes)
        self._factory = slab_factory or _private_slab
        self._free: list = []
        self._total = 0
        self._lock = threading.Lock()

    def acquire(self, n: int):
        with self._lock:
            best = None
            for slab in self._free:
                if slab[0].shape[0] >= n and (best is None or slab[0].shape[0] < best[0].shape[0]):
                    best = slab
            if best is not None:
                self._free.remove(best)
                return best
            cap = 16
            while cap < n:
                cap *= 2
            size = cap * sum(self.part_nbytes)
            if self._total + size > self.max_bytes:
                if self._free:  # drop cached small slabs to make room
                    self._total -= sum(s[0].shape[0] for s in self._free) * sum(self.part_nbytes)
                    self._free.clear()
                if self._total + size > self.max_bytes:
                    return None
            self._total += size
        return self._factory(cap, self.part_nbytes)

    def release(self, slab) -> None:
        if slab is None:
            return
        with self._lock:
            self._free.append(slab)


def stage_blocks(parts: Sequence[Any], rows_u8: Sequence[Any], block_ids: Sequence[int], slab=None) -> list:
    """Snapshot blocks `block_ids` of every part: one gather (index_select) per part, each a
    single contiguous copy. Returns per part a (n, bytes_per_block) uint8 tensor (rows of `slab`
    when given); the stored value of block i is the concatenation of staged[p][i] over parts
    (see `values_from_staged`)."""
    import torch

    n = len(block_ids)
    idx = torch.tensor(list(block_ids), dtype=torch.long, device=parts[0].device)
    out = []
    for k, (p, rows) in enumerate(zip(parts, rows_u8)):
        dst = slab[k][:n] if slab is not None else None
        if rows is not None and rows.device.type == "cpu" and dst is not None:
            torch.index_select(rows, 0, idx, out=dst)
            staged = dst
        elif rows is not None:
            staged = rows.index_select(0, idx)
        else:  # non-contiguous part: copy block by block (each block itself is contiguous)
            staged = torch.stack([_u8(p[b]) for b in block_ids])
        if staged.device.type != "cpu":
            staged = staged.cpu() if dst is None else dst.copy_(staged)
        out.append(staged)
    return out


def values_from_staged(staged: Sequence[Any], which: Sequence[int]) -> list:
    """Stored values (as lists of byte pieces) of the blocks at positions `which`."""
    return [[s[i] for s in staged] for i in which]


def _pieces(value: Any) -> Sequence[Any]:
    return value if isinstance(value, (list, tuple)) else (value,)


def _nbytes(piece: Any) -> int:
    return piece.nbytes if isinstance(piece, memoryview) else int(piece.numel())


def value_nbytes(value: Any) -> int:
    """Bytes of one value `HostTransport.save` takes (a piece or a list of pieces)."""
    return sum(_nbytes(x) for x in _pieces(value))


def _fill(dst: memoryview, pieces: Sequence[Any]) -> None:
    """Write the pieces one after the other into `dst` (a writable byte view of a data-system buffer)."""
    import ctypes

    off, base = 0, None
    for x in pieces:
        n = _nbytes(x)
        if isinstance(x, memoryview):
            dst[off:off + n] = x.cast("B") if x.format != "B" else x
        elif x.device.type == "cpu" and x.is_contiguous():
            if base is None:
                base = ctypes.addressof(ctypes.c_char.from_buffer(dst))
            _memmove(base + off, x.data_ptr(), n)
        else:
            import torch

            torch.frombuffer(dst, dtype=torch.uint8)[off:off + n].copy_(x)
        off += n


class HostTransport(Transport):
    """KVClient shared-memory path (CPU tensors)."""

    def __init__(self, conn: DsConnection, max_batch_keys: int = 512, get_timeout_ms: int = 0,
                 write_mode: Any = None) -> None:
        self.conn = conn
        self.max_batch_keys = max_batch_keys
        self.get_timeout_ms = get_timeout_ms
        self.write_mode = write_mode  # the data system's WriteMode for new blocks; None: the client's default

    def _batches(self, n: int):
        step = self.max_batch_keys
        for i in range(0, n, step):
            yield i, min(n, i + step)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        out: list[bool] = []
        for lo, hi in self._batches(len(keys)):
            batch = list(keys[lo:hi])
            res = self.conn.call("exist", lambda c: c.exist(batch))
            out.extend(bool(x) for x in res)
        return out

    def held(self, keys: Sequence[str]) -> list[bool]:
        """`exists` for keys just written, where none being there is an answer, not an error (the client may raise
        when none of a batch exists)."""
        out: list[bool] = []
        for lo, hi in self._batches(len(keys)):
            try:
                out.extend(self.exists(keys[lo:hi]))
            except KeyError:
                out.extend([False] * (hi - lo))
        return out

    def save(self, keys: Sequence[str], values: Any, ttl_seconds: int) -> int:
        """values[i]: a 1-D uint8 tensor (e.g. a row of a 2-D staging tensor), a byte memoryview (a row of a shared
        staging slab, in the writer process, which has no torch), or a list of those written one after the other
        (see `values_from_staged`)."""
        written = 0
        for lo, hi in self._batches(len(keys)):
            batch = list(keys[lo:hi])
            sizes = [value_nbytes(values[i]) for i in range(lo, hi)]
            mode = {} if self.write_mode is None else {"write_mode": self.write_mode}
            bufs = self.conn.call("mcreate", lambda c: c.mcreate(batch, sizes, ttl_second=int(ttl_seconds), **mode))
            for j, buf in enumerate(bufs):
                dst = memoryview(buf.MutableData()).cast("B")
                if dst.nbytes != sizes[j]:
                    raise TransportError(f"mcreate gave {dst.nbytes} bytes for {batch[j]}, wanted {sizes[j]}")
                _fill(dst, _pieces(values[lo + j]))
            self.conn.call("mset_buffer", lambda c: c.mset_buffer(bufs))
            written += sum(sizes)
        return written

    def load(self, keys: Sequence[str], parts: Sequence[Any], layout: BlockLayout,
             block_ids: Sequence[int]) -> list[bool]:
        import torch

        ok = [False] * len(keys)
        raw = _cpu_contiguous_blocks(parts)
        for lo, hi in self._batches(len(keys)):
            batch = list(keys[lo:hi])
            try:
                bufs = self.conn.call("get", lambda c: c.get_read_only_buffers(batch, self.get_timeout_ms))
            except KeyError:
                continue  # none of this batch exists
            for j, buf in enumerate(bufs):
                if buf is None:
                    continue
                view = buf.immutable_data()
                if len(view) != layout.block_nbytes:
                    logger.warning("yrpd connector: %s has %d bytes, expected %d; not loading it",
                                   batch[j], len(view), layout.block_nbytes)
                    continue
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # read-only buffer; we only read it
                    src = torch.frombuffer(view, dtype=torch.uint8)
                b = block_ids[lo + j]
                if raw:  # CPU cache: one memmove per layer part, straight from shared memory
                    base = src.data_ptr()
                    for (ptr, size), off in zip(block_blobs(parts, b), layout.offsets):
                        _memmove(ptr, base + off, size)
                else:
                    for p, off, size in zip(parts, layout.offsets, layout.part_nbytes):
                        _u8(p[b]).copy_(src[off:off + size])
                ok[lo + j] = True
        return ok

    def delete(self, keys: Sequence[str]) -> None:
        for lo, hi in self._batches(len(keys)):
            batch = list(keys[lo:hi])
            self.conn.call("delete", lambda c: c.delete(batch))

    def expire(self, keys: Sequence[str], ttl_seconds: int) -> None:
        for lo, hi in self._batches(len(keys)):
            batch = list(keys[lo:hi])
            self.conn.call("expire", lambda c: c.expire(batch, int(ttl_seconds)))


class NpuTransport(Transport):
    """Device path through the data system's heterogeneous client (Ascend NPU only).

    Saves go device -> host memory of the data system (`mset_d2h`), loads host -> device
    (`mget_h2d`), one DeviceBlobList per block key gathering that block of every layer. Cannot
    run without CANN; `save_blocks`/`load_blocks` take block ids instead of staged bytes because
    the device client copies straight out of / into the paged cache.
    """

    def __init__(self, conn: DsConnection, device_id: int, blob_cls: Callable, dbl_cls: Callable,
                 set_param_cls: Callable, get_timeout_ms: int = 0, write_mode: Any = None) -> None:
        self.conn = conn
        self.device_id = device_id
        self.blob_cls = blob_cls
        self.dbl_cls = dbl_cls
        self.set_param_cls = set_param_cls
        self.get_timeout_ms = get_timeout_ms
        self.write_mode = write_mode

    def exists(self, keys: Sequence[str]) -> list[bool]:
        batch = list(keys)
        return [bool(x) for x in self.conn.call("exist", lambda c: c.exist(batch))]

    def save_blocks(self, keys: Sequence[str], parts: Sequence[Any], block_ids: Sequence[int],
                    ttl_seconds: int) -> int:
        dbls = device_blob_lists(parts, block_ids, self.device_id, self.blob_cls, self.dbl_cls)
        sp = set_param_for(ttl_seconds, self.set_param_cls, self.write_mode)
        batch = list(keys)
        self.conn.call("mset_d2h", lambda c: c.mset_d2h(batch, dbls, sp))
        return sum(size for d in dbls for size in (b.size for b in d.blob_list))

    def load(self, keys: Sequence[str], parts: Sequence[Any], layout: BlockLayout,
             block_ids: Sequence[int]) -> list[bool]:
        dbls = device_blob_lists(parts, block_ids, self.device_id, self.blob_cls, self.dbl_cls)
        batch = list(keys)
        try:
            failed = self.conn.call("mget_h2d", lambda c: c.mget_h2d(batch, dbls, self.get_timeout_ms))
        except KeyError:
            return [False] * len(batch)
        failed_set = set(failed or ())
        return [k not in failed_set for k in batch]

    def delete(self, keys: Sequence[str]) -> None:
        batch = list(keys)
        self.conn.call("delete", lambda c: c.delete(batch))

    def expire(self, keys: Sequence[str], ttl_seconds: int) -> None:
        return None  # the device client has no expire; entries carry their TTL from mset_d2h


def kvclient_factory(host: str, port: int, connect_timeout_ms: int, request_timeout_ms: int,
                     exclusive: bool) -> Callable[[], Any]:
    def make():
        from yr.datasystem import KVClient

        client = KVClient(host, port, connect_timeout_ms=connect_timeout_ms, req_timeout_ms=request_timeout_ms,
                          enable_exclusive_connection=exclusive)
        client.init()
        return client

    return make


def kv_connection(cfg: Any, name: str, on_event: Callable[[str], None] | None = None) -> DsConnection:
    """A DsConnection of KVClients to the worker `cfg` names (a ConnectorConfig), watching its port while down and
    trying a quick client first (QUICK_TIMEOUT_MS)."""
    def factory(cap_ms: int | None = None) -> Callable[[], Any]:
        connect, request = cfg.connect_timeout_ms, cfg.request_timeout_ms
        if cap_ms is not None:
            connect, request = min(cap_ms, connect), min(cap_ms, request)
        return kvclient_factory(cfg.ds_host, cfg.ds_port, connect, request, cfg.exclusive_connection)

    return DsConnection(factory(), name, cfg.retry_backoff_s, on_event, (cfg.ds_host, cfg.ds_port),
                        factory(QUICK_TIMEOUT_MS))


def hetero_client_factory(host: str, port: int, connect_timeout_ms: int, request_timeout_ms: int
                          ) -> Callable[[], Any]:
    def make():
        from yr.datasystem import HeteroClient

        client = HeteroClient(host, port, connect_timeout_ms=connect_timeout_ms, req_timeout_ms=request_timeout_ms)
        client.init()
        return client

    return make
