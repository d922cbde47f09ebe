"""The fake-host lab: hosts as network namespaces with their own sshd (and dockerd), on this machine, as root.

The tests under tests/lab and the scripts under benchmarks/ both use it; nothing of it ships with yrpd.
"""
