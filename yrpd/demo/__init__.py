"""The builders of the built-in models (yrpd.models names them), run on the hosts with their vLLM Python."""
