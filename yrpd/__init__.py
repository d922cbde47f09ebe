"""yrpd: prefill/decode-disaggregated vLLM serving on openYuanrong, deployed over SSH."""

__version__ = "0.1.0"
