"""Only the optional C helpers live here; everything else is in pyproject.toml."""

from setuptools import Extension, setup

# optional: without a C compiler kvcr still installs, copies with ctypes.memmove and hashes and
# indexes blocks in Python (the token hash also needs xxhash's header, Debian's libxxhash-dev).
setup(ext_modules=[Extension(name, [source], optional=True, extra_compile_args=["-O2"])
                   for name, source in (("kvcr._fastcopy", "kvcr/_fastcopy.c"),
                                        ("kvcr._tokenhash", "kvcr/_tokenhash.c"),
                                        ("router_hints._inventory", "router_hints/_inventory.c"))])
