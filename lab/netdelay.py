"""Hold every packet of a netfilter queue for a fixed time, then let it go: a link delay for kernels without sch_netem.

    python lab/netdelay.py --queue N --delay-ms MS

Run inside the network namespace whose packets an iptables rule sends to queue N (`-j NFQUEUE --queue-num N
--queue-bypass`: should this process die, packets pass undelayed rather than vanish). Packets leave in the order
they came, each `--delay-ms` after the kernel queued it, as `tc qdisc ... netem delay` would send them. Prints
"ready" once bound, and on SIGTERM a last line of JSON: {"packets": how many were delayed, "late_ms": the worst
lateness beyond the delay}.
"""

from __future__ import annotations

import argparse
import collections
import json
import select
import signal
import sys
import time

from netfilterqueue import NetfilterQueue

MAX_HELD = 65536  # packets held at once; beyond this the kernel drops (a 50 ms delay at ~1 GB/s fits)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--queue", type=int, required=True)
    p.add_argument("--delay-ms", type=float, required=True)
    args = p.parse_args()
    delay = args.delay_ms / 1000
    held: collections.deque = collections.deque()  # (due, packet): a fixed delay keeps it sorted
    stats = {"packets": 0, "late_ms": 0.0}

    def hold(packet) -> None:
        held.append((time.monotonic() + delay, packet))
        stats["packets"] += 1

    queue = NetfilterQueue()
    queue.bind(args.queue, hold, max_len=MAX_HELD)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    fd = queue.get_fd()
    print("ready", flush=True)
    try:
        while not stopping:
            now = time.monotonic()
            while held and held[0][0] <= now:
                due, packet = held.popleft()
                stats["late_ms"] = max(stats["late_ms"], (now - due) * 1000)
                packet.accept()
            timeout = max(held[0][0] - now, 0) if held else 0.5
            try:
                readable, _, _ = select.select([fd], [], [], timeout)
            except InterruptedError:
                continue
            if readable:
                queue.run(block=False)
    finally:
        for _, packet in held:  # let what is held through rather than drop it
            packet.accept()
        queue.unbind()
        stats["late_ms"] = round(stats["late_ms"], 2)
        print(json.dumps(stats), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
