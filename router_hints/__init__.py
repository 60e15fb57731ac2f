"""Router-side library: event-stream subscriber, inventory index, source selection and hints.

Imports only `kvcr.proto` (standard library, msgpack, xxhash) and pyzmq: no torch, ucxx or sglang.
"""
