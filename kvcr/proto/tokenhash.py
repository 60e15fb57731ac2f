"""Token-content hashes other systems use: Dynamo's LocalBlockHash and vLLM's block chain."""

from __future__ import annotations

import hashlib
import pickle
import struct
from array import array
from typing import Sequence

import xxhash

from .keys import U64_MASK

try:  # kvcr/_tokenhash.c, built at install where a compiler and xxhash's header are
    from .. import _tokenhash as _native
except ImportError:
    _native = None

DYNAMO_SEED = 1337
VLLM_NONE_HASH_SEED = "vllm-none-hash"


def dynamo_seed(lora_name: str | None = None, cache_namespace: str | None = None) -> int:
    seed = DYNAMO_SEED
    if lora_name:
        seed = (seed + xxhash.xxh3_64_intdigest(lora_name.encode("utf-8"), seed=0)) & U64_MASK
    if cache_namespace:
        seed = (seed + xxhash.xxh3_64_intdigest(cache_namespace.encode("utf-8"), seed=1)) & U64_MASK
    return seed


def dynamo_local_block_hashes(tokens: Sequence[int], block_size: int, *, lora_name: str | None = None,
                              cache_namespace: str | None = None, eagle: bool = False) -> list[int]:
    """Dynamo router's per-block content hash (complete blocks only)."""
    seed = dynamo_seed(lora_name, cache_namespace)
    window = block_size + 1 if eagle else block_size
    raw = memoryview(array("I", tokens)).cast("B")  # one conversion; blocks are zero-copy slices
    digest = xxhash.xxh3_64_intdigest
    return [digest(raw[start * 4:(start + window) * 4], seed=seed)
            for start in range(0, len(tokens) - window + 1, block_size)]


def dynamo_sequence_hashes(local_hashes: Sequence[int], parent: int | None = None) -> list[int]:
    """Sequence hashes of a chain of blocks, continuing from the parent block's (None: a root)."""
    out: list[int] = []
    digest, pack = xxhash.xxh3_64_intdigest, _PAIR.pack
    prev = parent
    for h in local_hashes:
        prev = h if prev is None else digest(pack(prev, h), seed=DYNAMO_SEED)
        out.append(prev)
    return out


def dynamo_block_sequence_hashes(tokens: Sequence[int], block_size: int, *, lora_name: str | None = None,
                                 cache_namespace: str | None = None, parent: int | None = None) -> list[int]:
    """Sequence hashes of the complete blocks of `tokens`, continuing from the parent block's:
    dynamo_local_block_hashes chained by dynamo_sequence_hashes, in one C call where built."""
    if _native is not None:
        return _native.sequence_hashes(tokens if isinstance(tokens, array) else array("I", tokens), block_size,
                                       dynamo_seed(lora_name, cache_namespace), parent)
    return dynamo_sequence_hashes(dynamo_local_block_hashes(tokens, block_size, lora_name=lora_name,
                                                            cache_namespace=cache_namespace), parent)


def dynamo_chain_hash(parent_sequence_hash: int, local_hash: int) -> int:
    """One step of dynamo_sequence_hashes: a block's sequence hash from its parent's."""
    return xxhash.xxh3_64_intdigest(_PAIR.pack(parent_sequence_hash, local_hash), seed=DYNAMO_SEED)


_PAIR = struct.Struct("<QQ")


def _cbor_head(major: int, value: int) -> bytes:
    if value < 24:
        return bytes([major << 5 | value])
    for code, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if value < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | code]) + struct.pack(fmt, value)
    raise ValueError(f"CBOR integer too large: {value}")


def cbor(obj: object) -> bytes:
    """Canonical CBOR for the few shapes vLLM hashes: bytes, uints, str, None, tuples."""
    if obj is None:
        return b"\xf6"
    if isinstance(obj, bytes):
        return _cbor_head(2, len(obj)) + obj
    if isinstance(obj, str):
        raw = obj.encode("utf-8")
        return _cbor_head(3, len(raw)) + raw
    if isinstance(obj, int) and obj >= 0:
        return _cbor_head(0, obj)
    if isinstance(obj, (tuple, list)):
        return _cbor_head(4, len(obj)) + b"".join(cbor(x) for x in obj)
    raise TypeError(f"cannot CBOR-encode {type(obj).__name__}")


def _pickle5(obj: object) -> bytes:
    return pickle.dumps(obj, protocol=5)


def vllm_encoder(algo: str):
    encoders = {"sha256_cbor": cbor, "sha256": _pickle5}
    if algo not in encoders:
        raise ValueError(f"unsupported vLLM hash algorithm {algo!r} (xxhash variants are not reproducible)")
    return encoders[algo]


def vllm_none_hash(algo: str = "sha256_cbor") -> bytes:
    return hashlib.sha256(vllm_encoder(algo)(VLLM_NONE_HASH_SEED)).digest()


def vllm_block_hashes(blocks: Sequence[Sequence[int]], *, algo: str = "sha256_cbor",
                      extra_keys: Sequence[tuple | None] | None = None) -> list[bytes]:
    """vLLM prefix-cache block hashes (PYTHONHASHSEED unset)."""
    encode = vllm_encoder(algo)
    parent = vllm_none_hash(algo)
    out = []
    for i, tokens in enumerate(blocks):
        extra = extra_keys[i] if extra_keys else None
        parent = hashlib.sha256(encode((parent, tuple(tokens), extra))).digest()
        out.append(parent)
    return out


def vllm_event_int(digest: bytes) -> int:
    """vLLM publishes the low 64 bits of the block hash."""
    return int.from_bytes(digest, "big") & U64_MASK
