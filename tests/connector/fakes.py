"""In-memory stand-ins for the data system's KVClient (pure Python, used by unit and in-process checks)."""

from __future__ import annotations


class FakeKVClient:
    """In-memory KVClient with the calls HostTransport uses (mcreate/mset_buffer/get_read_only_buffers)."""

    class Buf:
        def __init__(self, size):
            self.data = bytearray(size)

        def MutableData(self):
            return self.data

        def immutable_data(self):
            return memoryview(bytes(self.data))

    def __init__(self):
        self.store: dict = {}
        self.pending: dict = {}
        self.ttl: dict = {}
        self.write_modes: list = []  # the write_mode of each mcreate call
        self.down = False  # True: every call fails like a dead worker
        self.calls: list = []

    def _check(self, op):
        self.calls.append(op)
        if self.down:
            raise RuntimeError("code: [RPC unavailable], msg: [[UDS_CONNECT_FAILED] fake worker is down]")

    def health_check(self):
        fake = self

        class Status:
            def is_ok(self):
                return not fake.down

            def to_string(self):
                return "down" if fake.down else "ok"
        return Status()

    def exist(self, keys):
        self._check("exist")
        return [k in self.store for k in keys]

    def mcreate(self, keys, sizes, ttl_second=0, write_mode=None):
        self._check("mcreate")
        self.write_modes.append(write_mode)
        bufs = []
        for k, s in zip(keys, sizes):
            b = self.Buf(s)
            self.pending[id(b)] = k
            self.ttl[k] = ttl_second
            bufs.append(b)
        return bufs

    def mset_buffer(self, bufs):
        self._check("mset_buffer")
        for b in bufs:
            self.store[self.pending.pop(id(b))] = b

    def get_read_only_buffers(self, keys, timeout_ms=0):
        self._check("get")
        if not any(k in self.store for k in keys):
            raise RuntimeError("code: [Key not found], msg: [Cannot get objects from worker]")
        return [self.store.get(k) for k in keys]

    def delete(self, keys):
        self._check("delete")
        for k in keys:
            self.store.pop(k, None)
        return []

    def expire(self, keys, ttl):
        self._check("expire")
        for k in keys:
            self.ttl[k] = ttl
        return []
