"""The instances behind the proxy: health, in-flight counts, and the choice of the next one."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from .kvindex import InstanceBlocks, Sight, Store, host_of
from .routing import (DISK_LOAD_RATIO, LEARN_CHUNKS, LEARN_RATE, LOAD_WEIGHT, LOADABLE_PRIOR, RECENT_LEGS, WORK_WEIGHT,
                      PrefixMemory, Prompt, Routing)

ROLES = ("prefill", "decode")
#: why the proxy cannot see the cache of an instance out of rotation (its probe failed, or a request to it)
DOWN = "the instance is down"
#: how a prefill leg's KV blocks compare with what the KV-event index said the instance held (Instance.index_checked)
INDEX_OUTCOMES = ("right", "claimed_absent", "held_unclaimed")


@dataclass(eq=False)
class Instance:
    url: str
    role: str
    # Unknown until the first probe, which the proxy runs before it accepts requests.
    up: bool = False
    in_flight: int = 0
    requests: int = 0
    errors: int = 0
    last_error: str | None = None
    last_error_at: float | None = None
    #: requests sent here that share a leading prompt chunk with one sent here before (prefix routing)
    prefix_routed: int = 0
    #: prompt chunks the prefill legs in flight here are estimated still to compute (prefix routing's queue)
    queued: float = 0.0
    #: prompt chunks given to its prefill legs lately, decaying with every prefill leg routed (prefix routing)
    recent: float = 0.0
    #: seconds it takes per prompt chunk it computes: the seconds it had a leg in flight over the chunks its legs
    #: computed in them (moving averages of both, per leg ended, the one over the other), None until a leg taught
    #: it (prefix routing)
    chunk_s: float | None = None
    timed: tuple[float, float] | None = field(default=None, repr=False)  # (seconds, chunks), the averages above
    #: when its current spell with a leg in flight began (monotonic; None while idle), the seconds of its spells
    #: ended, and how many of its busy seconds a timed leg has accounted for
    busy_since: float | None = field(default=None, repr=False)
    busy_s: float = field(default=0.0, repr=False)
    busy_timed: float = field(default=0.0, repr=False)
    #: prefill legs routed to other instances since its last was timed: past RECENT_LEGS its own time is stale
    untimed_legs: int = 0
    memory: PrefixMemory = field(default_factory=PrefixMemory, repr=False)
    #: its prefix cache as its KV-cache events tell (yrpd.proxy.kvfeed); None where the proxy has no feed of them
    blocks: InstanceBlocks | None = field(default=None, repr=False)
    #: the chains of the legs in flight here: blocks its cache is computing, which no event has announced yet
    pending: list[list[bytes]] = field(default_factory=list, repr=False)
    #: taken out of routing: its legs in flight finish, no new one comes (scale-in, a rolling change, maintenance)
    draining: bool = False
    #: no longer a member: it goes once its last leg has ended
    leaving: bool = False
    #: KV blocks of its prefill legs' prompts, checked against what its prefix cache had when each leg was scheduled
    #: (the connector says): "right" where the index said held, "claimed_absent" where it said held and the cache
    #: lacked them (stale), "held_unclaimed" where the cache had them and the index did not say (lost or late)
    index_checked: dict[str, int] = field(default_factory=lambda: dict.fromkeys(INDEX_OUTCOMES, 0), repr=False)
    #: the model it serves ("served name#digest", the membership's "group"; "" where nobody said): a request's
    #: prefill and decode legs go to instances of one group, so no answer mixes two models while a change rolls
    group: str = ""

    @property
    def routable(self) -> bool:
        return self.up and not self.draining and not self.leaving

    def busy(self, now: float) -> float:
        """Seconds it has had a leg in flight, up to `now`."""
        return self.busy_s + (now - self.busy_since if self.busy_since is not None else 0.0)

    def note_error(self, message: str) -> None:
        self.last_error, self.last_error_at = message, time.time()

    def as_dict(self) -> dict:
        return {"url": self.url, "role": self.role, "up": self.up, "in_flight": self.in_flight,
                "requests": self.requests, "errors": self.errors, "last_error": self.last_error,
                "last_error_at": self.last_error_at, "prefix_routed": self.prefix_routed,
                "queued_chunks": round(self.queued, 1), "draining": self.draining or self.leaving,
                **({"ms_per_chunk": round(self.chunk_s * 1000, 2)} if self.chunk_s is not None else {}),
                **({"group": self.group} if self.group else {})}


@dataclass(eq=False)
class Lease:
    """One leg in flight on one instance, and the work it was charged there (released when the leg ends)."""

    instance: Instance
    work: float = 0.0
    matched: float = 0  # leading prompt chunks the instance holds: known from its events, else estimated
    loadable: float = 0  # chunks beyond those that another prefill instance finished: in the data system, likely
    prompt: Prompt | None = None
    new_blocks: int = 0  # full blocks of the prompt the instance's cache lacked, where its events tell (else 0)
    held_blocks: int | None = None  # leading blocks its events said it held when routed (None: not seeing them)
    pending: list[bytes] | None = None  # the chain it added to the instance's pending ones (prefix routing)
    store_told: bool = False  # its loadable chunks came from the data system's events, not the estimate
    store_new: int = 0  # full blocks of the prompt the data system lacked, where its events told: the leg saves them
    on_disk: float = 0  # of its loadable chunks, those the data system's index infers only its disk tier holds
    ahead: float = 0.0  # chunks queued on the instance when this leg was routed there
    chunk_s: float | None = None  # the seconds per chunk its cost was reckoned with (prefix routing's prefill legs)
    started: float = field(default_factory=time.monotonic)
    released: bool = False


def _survival(inst: Instance, prompt: Prompt) -> float:
    """The share of the blocks `inst`'s KV-cache events say it holds that is likely still held once the chunks
    queued there (`queued`) have been computed: their new blocks evict old ones where its cache is full. 1 where
    its events tell nothing exact (the estimate's memory has no size to go by)."""
    blocks = inst.blocks
    if blocks is None or not blocks.block_size or not prompt.tokens or prompt.chunks <= 0:
        return 1.0
    ahead = inst.queued * len(prompt.tokens) / prompt.chunks / blocks.block_size
    return blocks.survival(ahead)


class Pool:
    def __init__(self, prefill: list[str], decode: list[str], routing: Routing = Routing.load, bound: int = 2):
        self.routing, self.bound = routing, bound
        self.instances: list[Instance] = []
        for role, urls in (("prefill", prefill), ("decode", decode)):
            for url in dict.fromkeys(u.rstrip("/") for u in urls):
                self.instances.append(Instance(url, role))
        self._turn = {role: itertools.count() for role in ROLES}
        #: chains whose prefill leg finished: their KV was saved to the data system, where any instance may load it
        self.stored = PrefixMemory()
        #: how often a prefill leg that could load such chunks found them in the data system lately (0..1)
        self.loadable_found = LOADABLE_PRIOR
        #: seconds a prefill leg took per chunk it loaded from the data system's memory, beyond its computing:
        #: measured (the moving averages of those seconds and of the chunks loaded, the one over the other, a chunk
        #: its index took for on disk counted DISK_LOAD_RATIO times), None until a leg that loaded taught it
        self.load_chunk_s: float | None = None
        self._loads: tuple[float, float] | None = None  # (seconds, chunks), the averages above
        #: the data system's holdings as its workers' own events tell (yrpd.proxy.kvfeed.Feeds.store); None: not
        #: followed, the estimate above alone
        self.store: Store | None = None
        self.store_routed = 0  # prefill legs whose loadable chunks the store's events told

    def load_weight(self) -> float:
        """What a chunk another prefill instance finished costs here: a load where the data system still holds it
        (LOAD_WEIGHT), a computation where it was evicted (WORK_WEIGHT), weighed by how often loads were found."""
        return self.loadable_found * LOAD_WEIGHT + (1 - self.loadable_found) * WORK_WEIGHT

    def routing_state(self) -> dict:
        state: dict = {"policy": self.routing.value, "bound": self.bound}
        if self.routing is Routing.prefix:
            state.update(prompts_stored=len(self.stored), data_system_found=round(self.loadable_found, 3),
                         load_weight=round(self.load_weight(), 3), store_routed=self.store_routed)
            if self.load_chunk_s is not None:
                state["load_ms_per_chunk"] = round(self.load_chunk_s * 1000, 2)
        return state

    def chunk_s(self, inst: Instance) -> float | None:
        """Seconds a chunk computed on `inst` takes: its own measure, else the mean of the others' (a new
        instance), None while no leg has been measured (costs are then in chunks, the same order). An instance
        that got no leg for RECENT_LEGS prefill legs is taken for the others' mean again: one measured slow once
        (a pause, a cold start) would otherwise never get the leg that measures it anew."""
        if inst.chunk_s is not None and inst.untimed_legs < RECENT_LEGS:
            return inst.chunk_s
        known = [i.chunk_s for i in self.of(inst.role) if i.chunk_s is not None and i.untimed_legs < RECENT_LEGS]
        return sum(known) / len(known) if known else inst.chunk_s

    def observe(self, lease: Lease, loaded_blocks: int | None, now: float | None = None,
                cached_tokens: int | None = None, block_bytes: int | None = None,
                block_size: int | None = None) -> None:
        """A prefill leg finished (`loaded_blocks`: what its connector loaded from the data system; None when it
        did not say; `cached_tokens`: the prompt tokens the instance's own prefix cache had, where it said;
        `block_bytes`, `block_size`: what one of its blocks takes in the data system and its tokens, where it said):
        its prompt's KV is in the data system now, a leg that expected to load there tells how often that works, and
        its time what a chunk costs there."""
        if self.routing is not Routing.prefix or lease.prompt is None or lease.instance.role != "prefill":
            return
        if loaded_blocks is None:
            # a connector that does not say what it loads (another store, an older yrpd) would never correct the
            # estimate, so its prompts are not taken for loadable either
            return
        if self.store is not None:
            if block_bytes:
                self.store.learn_block_bytes(block_bytes)
            prompt = lease.prompt
            if loaded_blocks > 0 and cached_tokens is not None and block_size and prompt.tokens and not prompt.foreign:
                # the blocks it read, those past what its own cache had (where the connector starts its loads): in
                # the data system's memory now
                first = cached_tokens // block_size
                self.store.touch(prompt.store_hashes(block_size)[first:first + loaded_blocks])
        self.stored.remember(lease.prompt.chain)
        # a leg routed on what the data system said it holds teaches nothing of how often the estimate's "stored
        # lately" is still there: it only loaded where the blocks were said to be
        if lease.loadable >= LEARN_CHUNKS and not lease.store_told:
            found = 1.0 if loaded_blocks > 0 else 0.0
            self.loadable_found = _average(self.loadable_found, found)
        self._time(lease, loaded_blocks, time.monotonic() if now is None else now, cached_tokens)

    @staticmethod
    def checked(lease: Lease, cached_tokens: int | None, block_size: int | None) -> tuple[int, int] | None:
        """A prefill leg routed on the instance's KV-cache events ended, and its connector said how many prompt
        tokens the instance's own prefix cache had when the leg was scheduled: count how the index's claim compares
        (Instance.index_checked). Returns (blocks claimed, blocks found), None where either side did not say. The
        two moments differ (legs ahead of it store and evict meanwhile), so a few blocks off is the queue; a
        growing share is an index that has drifted from the cache."""
        if lease.held_blocks is None or cached_tokens is None or block_size is None or block_size < 1:
            return None
        claimed, found = lease.held_blocks, cached_tokens // block_size
        counts = lease.instance.index_checked
        counts["right"] += min(claimed, found)
        counts["claimed_absent"] += max(0, claimed - found)
        counts["held_unclaimed"] += max(0, found - claimed)
        return claimed, found

    def _time(self, lease: Lease, loaded_blocks: int, now: float, cached_tokens: int | None) -> None:
        # An instance's time per chunk is the seconds it was busy (a leg in flight) over the chunks computed in
        # them, each leg that ends bringing the busy seconds since the last one ended: a leg's own time from
        # routing would count the legs ahead of it whole though partly done, and a busy instance would look fast.
        # Chunks loaded from the data system count at what a load costs against a computation.
        inst, prompt = lease.instance, lease.prompt
        busy = inst.busy(now)
        spent, inst.busy_timed = busy - inst.busy_timed, busy
        loaded = prompt.loaded_chunks(loaded_blocks, inst.blocks, lease.loadable)
        if loaded is None:
            return
        # what the instance computed: the prompt less what its cache had (as its connector says, where the prompt's
        # tokens are known: the index's claim or the estimate may be off) and what it loaded
        matched = lease.matched
        if cached_tokens is not None and prompt.tokens:
            matched = min(cached_tokens, len(prompt.tokens)) * prompt.chunks / len(prompt.tokens)
        computed = prompt.work(matched + loaded)
        if loaded:
            # in loads from memory: one from the disk tier counts DISK_LOAD_RATIO of them
            from_memory = loaded + (DISK_LOAD_RATIO - 1) * min(lease.on_disk, loaded)
            if inst.chunk_s is not None and loaded >= LEARN_CHUNKS:
                # the busy seconds the leg brought beyond computing its own chunks at the instance's rate, per chunk
                # loaded (not its time from routing: the same whole-queue fault). A sample may be below 0 where legs
                # overlapped, so the averages are clamped, not each sample.
                extra = spent - inst.chunk_s * computed
                seconds, chunks = self._loads or (extra, from_memory)
                self._loads = (_average(seconds, extra), _average(chunks, from_memory))
                self.load_chunk_s = max(0.0, self._loads[0] / self._loads[1])
            ratio = (self.load_chunk_s / inst.chunk_s if self.load_chunk_s is not None and inst.chunk_s
                     else LOAD_WEIGHT / WORK_WEIGHT)
            computed += from_memory * ratio
        seconds, chunks = inst.timed or (spent, computed)
        inst.timed = (_average(seconds, spent), _average(chunks, computed))
        inst.chunk_s, inst.untimed_legs = inst.timed[0] / inst.timed[1], 0

    def of(self, role: str) -> list[Instance]:
        return [i for i in self.instances if i.role == role]

    def up(self, role: str) -> list[Instance]:
        """The instances of `role` a new leg may go to."""
        return [i for i in self.of(role) if i.routable]

    def sync(self, members: list[tuple[str, str, bool, str]]) -> tuple[list[Instance], list[Instance]]:
        """Make the membership `members`, (url, role, draining, group) each: a new instance joins down (its first
        probe brings it in), a gone one leaves at once when nothing is in flight there, else once its last leg ends.
        Returns (joined, left)."""
        wanted = {url.rstrip("/"): (role, draining, group) for url, role, draining, group in members}
        joined, left = [], []
        for inst in list(self.instances):
            role, draining, group = wanted.get(inst.url, (None, False, ""))
            if role == inst.role and group == inst.group:
                inst.draining, inst.leaving = draining, False
            elif not inst.leaving:
                inst.leaving = True
                left.append(inst)
        known = {(i.url, i.role, i.group) for i in self.instances if not i.leaving}
        for url, (role, draining, group) in wanted.items():
            if (url, role, group) not in known:
                inst = Instance(url, role, draining=draining, group=group)
                self.instances.append(inst)
                joined.append(inst)
        self.reap()
        return joined, left

    def groups(self, model: object = None, roles: tuple[str, ...] = ROLES) -> set[str]:
        """The model groups with an instance of each of `roles` up (PD: a prefill and a decode instance), those
        serving `model` (the request's "model") alone where any does."""
        complete = set.intersection(*({i.group for i in self.up(role)} for role in roles))
        named = {g for g in complete if g.rsplit("#", 1)[0] == model}
        return named or complete

    def missing(self) -> list[str]:
        """The roles with no instance up."""
        return [role for role in ROLES if not self.up(role)]

    def reap(self) -> None:
        """Drop the leaving instances whose last leg has ended."""
        self.instances = [i for i in self.instances if not (i.leaving and i.in_flight == 0)]

    def acquire(self, role: str, exclude: list[Instance] | tuple = (), prompt: Prompt | None = None,
                groups: set[str] | None = None, now: float | None = None) -> Lease | None:
        """Choose an up instance for one leg (see `select`; of `groups` alone where given) and count the leg on it
        until `release` (`now`: the monotonic time it starts, for tests)."""
        lease = self._choose(role, exclude, prompt, groups)
        if lease is None:
            return None
        inst = lease.instance
        if now is not None:
            lease.started = now
        if inst.in_flight == 0:
            inst.busy_since = lease.started
        inst.in_flight += 1
        inst.requests += 1
        lease.ahead = inst.queued
        inst.queued += lease.work
        if self.routing is Routing.prefix and prompt is not None and prompt.chain:
            if lease.matched:
                inst.prefix_routed += 1
            self.store_routed += lease.store_told
            inst.memory.remember(prompt.chain)
            inst.pending.append(prompt.chain)
            lease.pending = prompt.chain
            if inst.role == "prefill":
                lease.chunk_s = self.chunk_s(inst)
                for other in self.of("prefill"):
                    other.recent *= 1 - 1 / RECENT_LEGS
                    if other is not inst:
                        other.untimed_legs += 1
                inst.recent += lease.work
        return lease

    def release(self, lease: Lease, now: float | None = None) -> None:
        """End a leg (`now`: the monotonic time it ended, for tests); a second release of the same lease does
        nothing."""
        if lease.released:
            return
        lease.released = True
        inst = lease.instance
        inst.in_flight -= 1
        if inst.in_flight == 0 and inst.busy_since is not None:
            inst.busy_s += (time.monotonic() if now is None else now) - inst.busy_since
            inst.busy_since = None
        if lease.pending is not None:
            inst.pending = [c for c in inst.pending if c is not lease.pending]
        inst.queued = max(0.0, inst.queued - lease.work)
        if inst.leaving and inst.in_flight == 0:
            self.reap()

    def select(self, role: str, exclude: list[Instance] | tuple = (), prompt: Prompt | None = None
               ) -> Instance | None:
        """The instance the next leg would go to; nothing is counted or remembered.

        By load: the up instance with the fewest requests in flight (ties round robin). With prefix routing, a
        prefill leg goes where its prompt costs least (the expected time of the chunks queued there, those it would
        compute there, weighted, and those it would load; among equals, the instance given the least work lately),
        a decode leg to the least busy instance (among equals, the one that saw most of the prompt); neither to an
        instance `bound` busier than the least busy one."""
        lease = self._choose(role, exclude, prompt)
        return lease.instance if lease else None

    def _choose(self, role: str, exclude, prompt: Prompt | None, groups: set[str] | None = None) -> Lease | None:
        members = self.of(role)
        if not members:
            return None
        start = next(self._turn[role]) % len(members)
        # min() keeps the first of equals, so rotating the start spreads ties over the members.
        rotated = members[start:] + members[:start]
        candidates = [i for i in rotated if i.routable and i not in exclude and (groups is None or i.group in groups)]
        if self.routing is Routing.round_robin:
            return Lease(candidates[0]) if candidates else None
        least = min(candidates, key=lambda i: i.in_flight, default=None)
        if least is None or self.routing is not Routing.prefix or prompt is None or not prompt.chain:
            return None if least is None else Lease(least)
        within = [i for i in candidates if i.in_flight - least.in_flight < self.bound]
        matched = {i: self.seen(i, prompt) for i in within}  # Instance hashes by identity (eq=False)
        if role != "prefill":
            chosen = min(within, key=lambda i: (i.in_flight, -matched[i]))
            return Lease(chosen, 0.0, matched[chosen], prompt=prompt)
        stored = self.stored.matched(prompt.chain)
        found = self.loadable_found
        block_size = self.block_size()
        told = prompt.in_store(self.store, block_size, {host_of(i.url) for i in self.up("prefill")})
        disk: tuple[bool, ...] = ()
        if told is not None:  # what the data system holds, as it says: loads found there for sure
            if self.store.memory_blocks is not None:  # a disk tier behind the workers' memory
                disk = prompt.store_on_disk(self.store, block_size, told)
            stored, found = prompt.block_chunks(told, block_size), 1.0
        # what an instance holds now, as far as it is likely still held when the legs queued there have run: a
        # long queue computes new blocks that evict old ones (what the index says at routing is not what the cache
        # holds when a queued leg runs)
        kept = {i: matched[i] * _survival(i, prompt) for i in within}

        def loadable(i: Instance) -> float:
            return max(0, stored - kept[i])

        def on_disk(i: Instance) -> float:
            # of the blocks past what the instance holds, those only the data system's disk tier has
            if not any(disk):
                return 0.0
            per_block = prompt.block_chunks(1, block_size)
            held = int(kept[i] / per_block + 1e-9)  # (chunks back to blocks: a float a hair under a whole block)
            return min(sum(disk[held:]) * per_block, loadable(i))

        def cost(i: Instance) -> float:
            # Expected seconds: this leg's wait and work, its work counted WORK_WEIGHT times (it also delays every
            # later leg there). Until a leg is measured, chunks: what a load costs then comes from LOAD_WEIGHT.
            chunk = self.chunk_s(i)
            chunk = 1.0 if chunk is None else chunk
            load = self.load_chunk_s if self.load_chunk_s is not None else chunk * LOAD_WEIGHT / WORK_WEIGHT
            # a disk load, DISK_LOAD_RATIO memory loads; until loads are measured, no dearer than computing the chunk
            disk_load = load * DISK_LOAD_RATIO if self.load_chunk_s is not None else min(load * DISK_LOAD_RATIO, chunk)
            fetch = loadable(i) * (found * load + (1 - found) * chunk) + on_disk(i) * (disk_load - load)
            return chunk * (i.queued + WORK_WEIGHT * prompt.work(max(kept[i], stored))) + WORK_WEIGHT * fetch

        chosen = min(within, key=lambda i: (cost(i), i.in_flight, i.recent))
        # charged to its queue: what it is expected to compute (the loadable part where the data system lost it)
        work = prompt.work(max(kept[chosen], stored)) + (1 - found) * loadable(chosen)
        held, new = prompt.blocks_at(chosen.blocks)
        store_new = prompt.store_lacks(self.store, block_size) if told is not None else 0
        return Lease(chosen, work, matched[chosen], loadable(chosen), prompt, new_blocks=new, held_blocks=held,
                     store_told=told is not None, store_new=store_new, on_disk=on_disk(chosen))

    def block_size(self) -> int:
        """Tokens per KV block, as the prefill instances' events say (0 until one has stored a block)."""
        return max((i.blocks.block_size for i in self.of("prefill") if i.blocks is not None), default=0)

    @staticmethod
    def seen(inst: Instance, prompt: Prompt) -> float:
        """Leading chunks of `prompt` `inst` holds: what its KV-cache events tell where they tell it exactly, and
        what the legs in flight there are computing (no event tells that before they end); else what it was sent
        before."""
        held = prompt.held(inst.blocks)
        if held is None:
            return inst.memory.matched(prompt.chain)
        coming = max((_common(prompt.chain, c) for c in inst.pending), default=0)
        return max(held[0], coming)

    def failed(self, inst: Instance, message: str, *, down: bool) -> None:
        """A request to `inst` failed; a dead-looking instance leaves the rotation until a probe brings it back."""
        inst.errors += 1
        inst.note_error(message)
        if down:
            self._down(inst)

    def probed(self, inst: Instance, ok: bool, message: str | None = None) -> bool:
        """Record a /health probe; True when this changed the instance's state."""
        changed = inst.up != ok
        if ok:
            inst.up = True
        else:
            self._down(inst)
        if not ok and changed and message:
            inst.note_error(message)
        return changed

    @staticmethod
    def _down(inst: Instance) -> None:
        # a restarted instance starts with an empty prefix cache: what it was sent before no longer tells, and what
        # its events said is unknown until they speak again (its new run's, from batch 0, make the copy exact)
        inst.up = False
        inst.memory.forget()
        if inst.blocks is not None and inst.blocks.sight is not Sight.never:
            inst.blocks.go_blind(DOWN, lagging=True)


def _average(old: float | None, sample: float) -> float:
    return sample if old is None else old + LEARN_RATE * (sample - old)


def _common(a: list[bytes], b: list[bytes]) -> int:
    """The leading chunks two chains share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
