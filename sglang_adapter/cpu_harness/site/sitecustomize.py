"""Loaded by every Python process of a harness SGLang server (PYTHONPATH): patches applied right
after the modules they touch are imported, so nothing is imported early."""

from kvcr_sglang_cpu import install

install()
