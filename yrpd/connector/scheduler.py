"""The scheduler half of YuanrongConnector (runs in vLLM's engine-core process, one per engine).

* Producer: every step, for every scheduled request, the prompt blocks that became complete in this step
  (whatever the chunking) go into the step's metadata as (prefix digest, block id) pairs for the workers to
  save; for a request prefill hands over to decode, so does the partial block holding the prompt's last token
  once the prompt is computed (`keys.handover_tail`); `request_finished` announces what was saved.
* Consumer: `get_num_new_matched_tokens` asks the data system which of the request's loadable blocks exist
  for all TP/PP ranks and promises only the leading run of present ones, waiting (answering None) up to
  ready_wait_ms for blocks prefill announced but has not finished writing. Where prefill announced the
  hand-over's last block, it is promised too, so the engine computes one prompt token, not up to a block of
  them. `update_state_after_alloc` turns the promise into the load plan of the next step's metadata.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from yrpd.connector import keys as K
from yrpd.connector.common import BlockOp, ConnectorContext, ConnectorHalf, YuanrongConnectorMetadata, logger
from yrpd.connector.transport import TransportError

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

_POLL_S = 0.01  # consumer: at most one existence query per waiting request per 10 ms
_SAVED_MAX = 1 << 16  # producer: the blocks it remembers saving (a digest and a time: about 250 bytes each)


def _count(value) -> int:
    """A count the producer announced; anything else (absent, null, not a number) is 0, each field on its own."""
    try:
        return max(0, int(value or 0))
    except (TypeError, ValueError):
        return 0


@dataclass
class _ReqState:
    """Producer-side tracking of one request."""

    req_id: str
    token_ids: list
    extra: tuple
    block_ids: list = field(default_factory=list)
    saved_upto: int = 0
    digests: list = field(default_factory=list)
    tail_saved: bool = False  # the hand-over's partial last block is in a save plan
    local_upto: int = 0  # blocks vLLM's own prefix cache supplied when first scheduled (none computed here)

    def digests_upto(self, n: int, block_size: int) -> list:
        if len(self.digests) < n:
            self.digests = K.prefix_digests(self.token_ids, block_size, n, self.extra)
        return self.digests[:n]


@dataclass
class _Lookup:
    start: int  # first block index not computed locally
    hits: int  # leading present blocks from start
    digests: list  # digests of blocks [0, start + hits)
    checked_at: float = 0.0
    first_at: float = 0.0
    announced: int = 0  # blocks prefill said it handed over (PD); 0 for a request that came to this instance alone
    tail: int = 0  # tokens of the hand-over's last block prefill announced (keys.handover_tail); 0: none
    tail_digest: str | None = None
    tail_seen: bool = False  # that last block is in the data system
    tail_hit: bool = False  # ... and so is every loadable block before it (or this instance holds them)

    def complete(self) -> bool:
        """Nothing more of what prefill announced can still appear. Prefill's saver writes a request's blocks in
        order and its last block last, so once that one is visible a block still missing was evicted or failed,
        not late: waiting longer would only delay the recompute."""
        return self.tail_seen or (self.start + self.hits >= self.announced and not self.tail)


def _request_extra(lora_request: Any, cache_salt: Any, mm_ids: list) -> tuple:
    lora = None if lora_request is None else getattr(lora_request, "lora_name", None) or str(lora_request)
    return K.request_extra(lora, cache_salt, mm_ids)


def _mm_ids(obj: Any) -> list:
    """Identities of a request's multimodal inputs: `mm_features` (vLLM >= 0.11) or `mm_hashes` (vLLM 0.10,
    the vllm-ascend v0.10 image), on a Request and on the scheduler's NewRequestData alike."""
    features = getattr(obj, "mm_features", None)
    if features:
        return [getattr(f, "identifier", None) or getattr(f, "mm_hash", None) for f in features]
    return list(getattr(obj, "mm_hashes", None) or ())


def _eligible(request: "Request") -> tuple[list, tuple] | None:
    tokens = getattr(request, "prompt_token_ids", None)
    if not tokens or getattr(request, "prompt_embeds", None) is not None:
        return None
    extra = _request_extra(getattr(request, "lora_request", None), getattr(request, "cache_salt", None),
                           _mm_ids(request))
    return tokens, extra


class ConnectorScheduler(ConnectorHalf):
    """Save plans (producer) and existence lookups plus load plans (consumer)."""

    side = "scheduler"

    def __init__(self, ctx: ConnectorContext, *, can_wait: bool, can_recompute: bool) -> None:
        """`can_wait` / `can_recompute`: what the running vLLM supports (decided by the vLLM-facing class)."""
        super().__init__(ctx)
        self._can_wait = can_wait
        self._states: dict[str, _ReqState] = {}
        self._lookups: dict[str, _Lookup] = {}
        self._loaded_upto: dict[str, int] = {}
        #: producer: the requests whose KV goes on to a decode instance -> the prompt tokens each found in the
        #: instance's own prefix cache when first scheduled (told to the proxy, which checks its KV-event index by it)
        self._handover: dict[str, int] = {}
        self._loaded_blocks: dict[str, int] = {}  # blocks each request took from the data system (told to the proxy)
        self._pending_loads: list[BlockOp] = []
        #: producer: prefix digest -> when this instance last planned its save (resave_after_s)
        self._saved: OrderedDict[str, float] = OrderedDict()
        self._refused_logged: dict[str, float] = {}
        self._rank_ns = [ctx.namespace(t, p).digest for p in range(ctx.pp_size) for t in range(ctx.tp_size)]
        ktc = ctx.ktc
        policy = getattr(ktc, "kv_load_failure_policy", None)
        if policy is not None and policy != "recompute":
            try:
                ktc.kv_load_failure_policy = "recompute"
                logger.warning("yrpd connector: kv_load_failure_policy=%s changed to 'recompute' (a block that "
                               "cannot be loaded is recomputed instead of failing the request)", policy)
            except Exception as e:  # noqa: BLE001
                logger.warning("yrpd connector: cannot set kv_load_failure_policy=recompute (%s); pass it in "
                               "--kv-transfer-config", e)
        self._loads = self._active and self.cfg.is_consumer
        if self._loads and not can_recompute:
            self._loads = False
            logger.warning("yrpd connector: this vLLM cannot recompute KV blocks that fail to load (it has no "
                           "get_block_ids_with_load_errors; vLLM >= 0.11 has): the %s role loads nothing here and "
                           "every prompt is computed, so a failed load can never be used as KV", self.cfg.role)
        if self._loads:
            self._conn = self._make_conn("scheduler")
            self._conn.connect()
        self._start_reporter(0, ",".join(self._rank_ns))
        logger.info("yrpd connector (scheduler, %s): ds=%s:%d block_size=%d model=%s ns=%s ttl=%ds "
                    "delete_after_load=%s", self.cfg.role, self.cfg.ds_host, self.cfg.ds_port, self.block_size,
                    ctx.model_identity, ",".join(self._rank_ns), self.cfg.ttl_seconds, self.cfg.delete_after_load)

    # -- consumer: lookups ---------------------------------------------------------------------------
    def _exists_all_ranks(self, digests: list[str]) -> list[bool]:
        assert self._conn is not None
        all_keys = [K.key_for(ns, d) for ns in self._rank_ns for d in digests]
        # the data system refuses a call naming too many keys, and TP ranks x blocks of a long prompt can be thousands
        step = self.ctx.cfg.max_batch_keys
        res: list = []
        for i in range(0, len(all_keys), step):
            batch = all_keys[i:i + step]
            res += self._conn.call("exist", lambda c, batch=batch: c.exist(batch))
        n = len(digests)
        return [all(bool(res[r * n + i]) for r in range(len(self._rank_ns))) for i in range(n)]

    def _handoff_mismatch(self, info: dict) -> str | None:
        """What makes KV a producer announced unusable here, in words; None when it matches this instance."""
        theirs = {"dtype": info.get("kv_dtype"), "block size": info.get("block_size"), "model": info.get("model")}
        ours = {"dtype": self.ctx.kv_dtype, "block size": self.block_size, "model": self.ctx.model_identity}
        differ = [f"{what} {theirs[what]} there, {ours[what]} here" for what in theirs
                  if theirs[what] is not None and theirs[what] != ours[what]]
        return "; ".join(differ) or None

    def _refuse_handoff(self, req_id: str, mismatch: str) -> None:
        self.stats.inc("handoff_refused")
        now = time.monotonic()
        if now - self._refused_logged.get(mismatch, -1e9) >= 60.0:  # one line a minute per kind of mismatch
            self._refused_logged[mismatch] = now
            logger.error("yrpd connector: refusing the KV prefill computed for %s (%s): recomputing the prompt; "
                         "deploy prefill and decode with the same model and --dtype", req_id, mismatch)

    def _announced(self, request: "Request", num_tokens: int) -> tuple[int, int]:
        """(full blocks, tokens of the last block) prefill said it handed over; (0, 0) when nothing usable."""
        params = getattr(request, "kv_transfer_params", None) or {}
        info = params.get("yrpd") if isinstance(params, dict) else None
        if not isinstance(info, dict):
            return 0, 0
        mismatch = self._handoff_mismatch(info)
        if mismatch:
            self._refuse_handoff(request.request_id, mismatch)
            return 0, 0
        if info.get("ns") and info.get("ns") != ",".join(self._rank_ns):
            return 0, 0  # produced under another namespace: those keys will never show up here
        blocks, tail = _count(info.get("num_blocks")), _count(info.get("tail"))
        # a tail for another prompt length cannot be this request's (a producer without tails sends none)
        return blocks, tail if tail == K.handover_tail(num_tokens, self.block_size) else 0

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int):
        if self._active and self.cfg.is_producer:
            params = getattr(request, "kv_transfer_params", None)
            if isinstance(params, dict) and params.get("do_remote_decode"):
                self._handover.setdefault(request.request_id, num_computed_tokens)
        if not self._loads or self._conn is None:
            return 0, False
        elig = _eligible(request)
        if elig is None:
            return 0, False
        tokens, extra = elig
        bs = self.block_size
        n_max = K.loadable_blocks(len(tokens), bs)
        start = num_computed_tokens // bs
        announced, tail = self._announced(request, len(tokens))
        announced = min(announced, n_max)
        if n_max < start or (n_max == start and not tail):
            return 0, False
        req_id = request.request_id
        now = time.monotonic()
        lk = self._lookups.get(req_id)
        if lk is not None and lk.start != start:
            lk = None

        def may_wait(since: float) -> bool:
            return self._can_wait and (now - since) * 1000.0 < self.cfg.ready_wait_ms

        if lk is not None and not lk.complete() and may_wait(lk.first_at) and now - lk.checked_at < _POLL_S:
            return None, False  # still waiting; do not hammer the data system
        if not self._conn.healthy:
            # the data system is away: recompute, and count it, or status would show no sign of the lost reuse
            self.stats.inc("lookup_errors")
            self._lookups.pop(req_id, None)
            return 0, False
        t0 = time.perf_counter()
        if lk is not None:
            digests, tail_digest = lk.digests, lk.tail_digest
        else:
            chain = K.prefix_digests(tokens, bs, n_max + 1, extra)  # the hand-over's last block may be a full one
            digests = chain[:n_max]
            tail_digest = K.handover_digest(tokens, bs, chain, extra) if tail else None
        try:
            present = self._exists_all_ranks(digests[start:n_max] + ([tail_digest] if tail_digest else []))
        except (TransportError, KeyError) as e:
            self.stats.inc("lookup_errors")
            logger.debug("yrpd connector: lookup for %s failed: %s", req_id, e)
            self._lookups.pop(req_id, None)
            return 0, False
        self.stats.observe("lookup", (time.perf_counter() - t0) * 1000.0)
        hits = K.leading_hits(present[:n_max - start])
        first_at = lk.first_at if lk is not None else now
        seen = bool(tail_digest) and present[-1]
        new = _Lookup(start, hits, digests, now, first_at, announced, tail, tail_digest,
                      tail_seen=seen, tail_hit=seen and start + hits == n_max)
        self._lookups[req_id] = new
        if not new.complete() and may_wait(first_at):
            if lk is None:
                self.stats.inc("lookup_waits")
            return None, False  # prefill announced more than is visible yet: ask again soon
        return hits * bs + (tail if new.tail_hit else 0), False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        req_id = request.request_id
        lk = self._lookups.pop(req_id, None)
        if num_external_tokens <= 0:
            if lk is not None:
                self._count_lookup(lk, 0)
                if lk.announced or lk.tail:  # a hand-over it could not use: `yrpd logs --request` shows why
                    logger.info("yrpd connector: request %s: loads nothing of the %d blocks prefill handed over "
                                "(visible: %d; waited %.0f ms): computes the prompt", req_id,
                                lk.announced + bool(lk.tail), lk.hits, (time.monotonic() - lk.first_at) * 1000)
            return
        bs = self.block_size
        n, tail = divmod(num_external_tokens, bs)
        block_ids = list(blocks.get_block_ids()[0])
        if lk is None or lk.hits < n or (tail and not (lk.tail_hit and tail == lk.tail and n == lk.hits)):
            # We never promised this: make the worker report the blocks as failed (recompute).
            start = (lk.start if lk is not None else 0)
            logger.warning("yrpd connector: unexpected external load of %d tokens for %s; reporting as failed",
                           num_external_tokens, req_id)
            self._pending_loads.append(BlockOp(req_id, [], block_ids[start:start + max(1, n + bool(tail))]))
            return
        self._count_lookup(lk, n, bool(tail))
        self._loaded_blocks[req_id] = n + bool(tail)
        # one line per request that loads: what tracing a request across hosts (`yrpd logs --request`) shows
        logger.info("yrpd connector: request %s: loads %d blocks%s from the data system (prefill handed over %d; "
                    "waited %.0f ms for them), first key %s", req_id, n, f" + a {tail}-token tail" if tail else "",
                    lk.announced, (time.monotonic() - lk.first_at) * 1000,
                    (lk.digests[lk.start:lk.start + 1] or [lk.tail_digest])[0])
        # The last block is copied whole: the slots past the tokens taken are rewritten before anything reads them.
        self._pending_loads.append(BlockOp(req_id, lk.digests[lk.start:lk.start + n] + ([lk.tail_digest] if tail else []),
                                           block_ids[lk.start:lk.start + n + bool(tail)]))
        self._loaded_upto[req_id] = lk.start + n

    def _count_lookup(self, lk: _Lookup, used: int, used_tail: bool = False) -> None:
        asked = len(lk.digests) - lk.start + bool(lk.tail_digest)
        self.stats.inc("lookup_requests")
        self.stats.inc("lookup_blocks", asked)
        self.stats.inc("lookup_hit_blocks", used + used_tail)
        self.stats.inc("lookup_miss_blocks", asked - used - used_tail)
        # Counted here, once per allocated request (a lookup is repeated while vLLM cannot allocate): blocks prefill
        # handed over that this instance computes again, because the data system evicted them or they came late.
        self.stats.inc("handoff_missed_blocks", max(0, lk.announced - lk.start - used)
                       + (1 if lk.tail and not used_tail else 0))

    # -- both roles: the step's metadata ---------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> YuanrongConnectorMetadata:
        meta = YuanrongConnectorMetadata(loads=self._pending_loads, saves=[])
        self._pending_loads = []
        if not (self._active and self.cfg.is_producer):
            return meta
        num_sched = scheduler_output.num_scheduled_tokens
        for new_req in scheduler_output.scheduled_new_reqs:
            tokens = new_req.prompt_token_ids
            if not tokens or getattr(new_req, "prompt_embeds", None) is not None:
                continue
            st = _ReqState(new_req.req_id, tokens,
                           _request_extra(new_req.lora_request, getattr(new_req, "cache_salt", None),
                                          _mm_ids(new_req)))
            st.block_ids = list(new_req.block_ids[0]) if new_req.block_ids else []
            st.saved_upto = self._loaded_upto.pop(new_req.req_id, 0)
            prev = self._states.get(new_req.req_id)
            if prev is not None:
                st.saved_upto = max(st.saved_upto, prev.saved_upto)
            st.tail_saved = prev is not None and prev.tail_saved
            st.local_upto = prev.local_upto if prev is not None else new_req.num_computed_tokens // self.block_size
            self._states[new_req.req_id] = st
            self._emit_saves(st, new_req.num_computed_tokens + num_sched.get(new_req.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._states.get(req_id)
            if st is None:
                continue
            nb = cached.new_block_ids[i]
            resumed = req_id in getattr(cached, "resumed_req_ids", ()) or \
                (hasattr(cached, "resumed_from_preemption") and cached.resumed_from_preemption[i])
            if resumed:
                st.block_ids = list(nb[0]) if nb else []
                st.saved_upto = max(st.saved_upto, self._loaded_upto.pop(req_id, 0))
            elif nb:
                st.block_ids.extend(nb[0])
            self._emit_saves(st, cached.num_computed_tokens[i] + num_sched.get(req_id, 0), meta)
        return meta

    # -- producer: saves -------------------------------------------------------------------------------
    def _emit_saves(self, st: _ReqState, computed_after: int, meta: YuanrongConnectorMetadata) -> None:
        bs = self.block_size
        rng = K.saveable_range(len(st.token_ids), st.saved_upto * bs, computed_after, bs)
        hi = min(rng.stop, len(st.block_ids)) if rng else st.saved_upto
        if hi > st.saved_upto:
            pairs = self._unsaved(st, list(zip(range(st.saved_upto, hi), st.digests_upto(hi, bs)[st.saved_upto:hi],
                                               st.block_ids[st.saved_upto:hi])))
            if pairs:
                meta.saves.append(BlockOp(st.req_id, [d for d, _ in pairs], [b for _, b in pairs]))
            st.saved_upto = hi
        n = len(st.token_ids)
        index = n // bs  # the partial block holding the last prompt token (a full one was saved above)
        if (st.req_id in self._handover and not st.tail_saved and K.handover_tail(n, bs) and n % bs
                and computed_after >= n and st.saved_upto == index and index < len(st.block_ids)):
            prev = st.digests_upto(index, bs)[-1] if index else None
            meta.saves.append(BlockOp(st.req_id, [K.tail_digest(st.token_ids, bs, prev, st.extra)],
                                      [st.block_ids[index]]))
            st.tail_saved = True

    def _unsaved(self, st: _ReqState, blocks: list[tuple[int, str, int]]) -> list[tuple[str, int]]:
        """The (digest, block id) pairs to save of `blocks` (index, digest, block id): a request that stays here
        leaves out the blocks its instance's own prefix cache supplied and this instance saved within
        resave_after_s (a chat's history every turn): copying them out again would delay the step for keys the data
        system most likely holds. A block the request computed is always saved (a first save that never landed is
        written then). A hand-over saves them all: decode needs every block, and one the data system evicted
        meanwhile would make it compute the whole prompt."""
        now, window = time.monotonic(), self.cfg.resave_after_s
        if window > 0 and st.req_id not in self._handover:
            kept = [(i, d, b) for i, d, b in blocks
                    if i >= st.local_upto or now - self._saved.get(d, float("-inf")) >= window]
            if len(kept) < len(blocks):
                self.stats.inc("save_skipped_recent_blocks", len(blocks) - len(kept))
            blocks = kept
        pairs = [(d, b) for _, d, b in blocks]
        for d, _ in pairs:
            self._saved[d] = now
            self._saved.move_to_end(d)
        while len(self._saved) > _SAVED_MAX:
            self._saved.popitem(last=False)
        return pairs

    def request_finished(self, request: "Request", block_ids: list[int]):
        req_id = request.request_id
        st = self._states.pop(req_id, None)
        self._lookups.pop(req_id, None)
        self._loaded_upto.pop(req_id, None)
        cached = self._handover.pop(req_id, None)
        loaded = self._loaded_blocks.pop(req_id, 0)
        if not (self._active and self.cfg.is_producer):
            return False, None
        if self.cfg.role == "kv_both" and getattr(request, "kv_transfer_params", None) is None:
            return False, None
        n = st.saved_upto if st is not None else 0
        tail = 0
        if st is not None:  # the hand-over's last block: the partial one saved, or the prompt's last full block
            num_tokens, bs = len(st.token_ids), self.block_size
            if st.tail_saved or (num_tokens % bs == 0 and n * bs >= num_tokens):
                tail = K.handover_tail(num_tokens, bs)
        # what the consumer checks before trusting the hand-over (namespaces alone cannot say what differs)
        # `loaded`: what this request took from the data system, which tells cache-aware routing how often the data
        # system still holds prefixes other instances computed (yrpd.proxy.pool.Pool.observe); `cached`: the prompt
        # tokens its own prefix cache had, against which the proxy checks what its KV-event index said
        # (yrpd.proxy.pool.Pool.checked)
        if n or tail:
            logger.info("yrpd connector: request %s: hands over %d blocks%s through the data system (loaded %d of "
                        "them from it)", req_id, n, f" + a {tail}-token tail" if tail else "", loaded)
        return False, {"yrpd": {"num_blocks": n, "tail": tail, "loaded": loaded, "block_size": self.block_size,
                                **({"cached": cached} if cached is not None else {}),
                                **({"block_bytes": self.ctx.block_bytes} if self.ctx.block_bytes else {}),
                                "ns": ",".join(self._rank_ns), "kv_dtype": self.ctx.kv_dtype,
                                "model": self.ctx.model_identity}}
