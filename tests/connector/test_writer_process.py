"""The producer's writer process (yrpd/connector/saver.py) against a real data-system worker: staged blocks read
back bit-exact through another client, a killed or hung writer costs its job (counted) and is started again, stray
output on its stdout does not confuse its answers, a slab the pool drops is unmapped in the writer too, and
neither stop() nor the death of the vLLM worker that started it leaves a writer behind. Runs
tests/connector/scripts/writer_process.py in the vLLM venv; about 20 s."""

from __future__ import annotations


import pytest

from tests.connector.harness import Stack, run_script

pytestmark = pytest.mark.e2e


def test_writer_process_saves_restarts_and_never_outlives_its_worker(vllm_venv, session_stack, e2e_root):
    stack = Stack(e2e_root / "writer", venv=vllm_venv, ports=session_stack.ports)
    try:
        ds = stack.start_ds(shm_mb=256)
        got = run_script(stack.venv, "writer_process.py", ds.address)
        print(f"measured: writer process {got}")
        assert got["flushed"] and got["saved"] == 64 and got["bit_exact"], got
        assert got["failed_after_kill"] == 3, got  # the job the killed writer never answered: counted, not lost
        assert got["second_pid"] not in (None, got["first_pid"]), got
        assert got["saved_after_restart"] == 2, got
        # a hung writer: its job is counted at the answer deadline, it is killed, and another one writes
        assert got["hang_flushed"] and got["failed_by_hang"] == 2 and got["hung_gone"], got
        assert got["third_pid"] not in (None, got["second_pid"]) and got["saved_after_hang"] == 1, got
        assert got["deaths"] == 2, got
        assert got["stopped"], got
        assert got["orphan_pid"] and got["orphan_gone"], got  # a SIGKILLed worker takes its writer along
        # stray output on the writer's stdout does not put its answers out of step
        assert got["noisy_saved"] == 28 and got["noisy_failed"] == 0 and got["noisy_deaths"] == 0, got
        # a slab the worker's pool dropped is unmapped by the writer too
        assert got["maps_first"] == 1 and got["maps_after_drop"] == 1, got
    finally:
        stack.close()
