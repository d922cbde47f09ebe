"""A shorter busy wait for vLLM's shared-memory message queues on CPU instances.

vLLM's multiprocessing executor (the only one its CPU platform runs) passes every step between the engine core and
its workers through shared-memory queues. A reader keeps spinning on its queue, yielding the CPU between looks,
for a whole second after each message before it sleeps on a socket (`SpinCondition.busy_loop_s`, not
configurable in vLLM 0.32). On an accelerator host that costs one idle core a second. On a CPU instance it costs
the very core the instance computes on: yrpd pins each CPU instance's worker to its own cores
(`VLLM_CPU_OMP_THREADS_BIND`), the connector's saver and the data system client's threads inherit that pinning,
and instances that share cores (more instances than cores: the fake-host lab, a small machine) wait for their
neighbour's spin to end. Measured on 4 fake hosts sharing 2 cores (docs/dev/notes.md, session 12): a third of the
requests took 0.9 s longer in their prefill or decode leg, the same leg that did not share a core never did, and
with the spin capped at 2 ms mean TTFT fell from 1.52 s to 0.69 s.

So on CPU the connector caps the spin (kv_connector_extra_config `cpu_spin_ms`, default 2; negative leaves vLLM as
it is) in the process it runs in: the scheduler half in the engine core, the worker half in each worker. A reader
that finds no message within the cap sleeps on vLLM's own notification socket, which wakes it on the next write;
a busy instance's next step arrives well within 2 ms and never waits for that socket.

That socket can lose a wake-up: the writer's PUB socket keeps at most one notification queued (`SNDHWM` 1) and
drops any sent while it counts one as queued, and vLLM 0.32 bounds what a lost one costs by looking at the queue
again every 5 s (`SHM_READER_RECHECK_INTERVAL_MS`). Spinning a second after each message, its readers rarely
sleep while busy; a capped reader sleeps after nearly every step, so a lost wake-up held a step, and every request
in it, for 5 s: the soak's p99 of 5.2 s (docs/reliability.md; py-spy showed the engine core waiting for its
worker's answer while the worker waited for its next request). A capped reader therefore sleeps at most
`RECHECK_MS` before it looks again: a lost wake-up costs at most that, an idle worker about 50 looks a second
(0.85 % of a core here: docs/bench/idle-reader-cpu.txt).
"""

from __future__ import annotations

import inspect
import logging

logger = logging.getLogger("yrpd.connector")

_MARK = "_yrpd_spin_cap_s"
#: the longest a capped reader sleeps on the notification socket before it looks at its queue again (see above)
RECHECK_MS = 20


def cap_spin(seconds: float) -> bool:
    """Cap every SpinCondition reader's busy wait in this process at `seconds`; True when vLLM's queue is the one
    this module knows (a later vLLM without it leaves nothing to cap, and the call changes nothing)."""
    try:
        from vllm.distributed.device_communicators import shm_broadcast
    except Exception:  # noqa: BLE001 - another vLLM layout: nothing to cap
        return False
    cond = getattr(shm_broadcast, "SpinCondition", None)
    wait = getattr(cond, "wait", None)
    if cond is None or wait is None:
        return False
    if hasattr(wait, _MARK):  # already capped in this process (one connector object per role)
        setattr(wait, _MARK, min(getattr(wait, _MARK), seconds))
        return True
    original = wait
    # a vLLM whose wait takes no timeout has no recheck of its own to shorten
    bounded = "timeout_ms" in inspect.signature(original).parameters

    def capped_wait(self, *args, **kwargs):
        cap = getattr(capped_wait, _MARK)
        # readers made before the cap (the worker's own queue is) are capped on their next wait
        if getattr(self, "busy_loop_s", 0) > cap:
            self.busy_loop_s = cap
        if bounded:
            asked = kwargs.pop("timeout_ms", args[0] if args else None)
            kwargs["timeout_ms"] = RECHECK_MS if asked is None else min(asked, RECHECK_MS)
            args = ()
        return original(self, *args, **kwargs)

    setattr(capped_wait, _MARK, seconds)
    capped_wait.__doc__ = original.__doc__
    cond.wait = capped_wait
    logger.info("yrpd connector: vLLM's message-queue readers in this CPU process spin at most %.0f ms after a "
                "message (vLLM: 1 s), so instances sharing cores do not wait for each other, and look again every "
                "%d ms while they sleep", seconds * 1000, RECHECK_MS)
    return True
