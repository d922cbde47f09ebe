"""OpenAI-compatible proxy in front of prefill and decode vLLM instances (run: `python -m yrpd.proxy`).

It runs in the vLLM venv on the proxy host with only a copy of the yrpd package on PYTHONPATH, so this
package uses nothing but the standard library and what vLLM itself depends on (aiohttp; pyzmq and msgspec for the
KV-event feed), and imports no other part of yrpd.
This module stays import-light: the aiohttp parts live in `yrpd.proxy.app`.
"""
