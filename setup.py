"""Only the optional C helper lives here; everything else is in pyproject.toml."""

from setuptools import Extension, setup

# optional: without a C compiler kvcr still installs and copies with ctypes.memmove instead.
setup(ext_modules=[Extension("kvcr._fastcopy", ["kvcr/_fastcopy.c"], optional=True, extra_compile_args=["-O2"])])
