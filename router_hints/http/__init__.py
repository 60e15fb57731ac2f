"""The reference router's HTTP front (`kvcr router`): config, request rewriting, aiohttp server."""
