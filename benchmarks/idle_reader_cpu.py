"""The CPU an idle reader of vLLM's shared-memory message queue costs, as vLLM leaves it and with yrpd's spin cap
(yrpd/connector/cpu_spin.py: a capped reader looks again every RECHECK_MS while it sleeps). Run in the vLLM venv:

    PYTHONPATH=. /opt/yrpd/venvs/vllm/bin/python benchmarks/idle_reader_cpu.py vllm|capped [SECONDS]

One reader thread waits on an idle queue for SECONDS (default 10); prints the process's CPU time over that time as a
share of one core (the writer sleeps throughout, so it is the reader's).
"""

import resource
import sys
import threading
import time

from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

from yrpd.connector.cpu_spin import cap_spin


def main() -> None:
    mode, seconds = sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 10.0
    if mode == "capped":
        cap_spin(0.002)
    writer = MessageQueue(1, 1)
    handle = writer.export_handle()

    def read() -> None:
        reader = MessageQueue.create_from_handle(handle, 0)
        reader.wait_until_ready()
        while reader.dequeue(indefinite=True) != "stop":
            pass

    t = threading.Thread(target=read, daemon=True)
    t.start()
    writer.wait_until_ready()
    writer.enqueue("first")
    time.sleep(1)  # past vLLM's own 1 s spin: from here the reader is idle either way
    u0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    time.sleep(seconds)
    u1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    cpu = (u1.ru_utime - u0.ru_utime) + (u1.ru_stime - u0.ru_stime)
    print(f"{mode}: an idle reader used {cpu / (t1 - t0) * 100:.2f} % of a core over {t1 - t0:.1f} s")
    writer.enqueue("stop")
    t.join(5)


if __name__ == "__main__":
    main()
