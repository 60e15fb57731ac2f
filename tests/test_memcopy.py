"""Bulk page copies: every byte lands where it should, whatever the split, alignment or path."""

from __future__ import annotations

import ctypes
import random
import shutil

import pytest

from kvcr.drivers import memcopy
from kvcr.drivers.memcopy import PARALLEL_MIN_BYTES, Copier, copy_serial


def _buffers(size: int, seed: int) -> tuple[ctypes.Array, ctypes.Array]:
    rng = random.Random(seed)
    src = ctypes.create_string_buffer(rng.randbytes(size), size)
    dst = ctypes.create_string_buffer(b"\xee" * size, size)
    return src, dst


def _scattered_ops(src, dst, sizes: list[int], seed: int) -> list[tuple[int, int, int]]:
    """Ops at odd offsets, taken from the source in one order and written in another."""
    rng = random.Random(seed)
    starts, at = [], 3  # odd start: the streaming path must align the head itself
    for n in sizes:
        starts.append(at)
        at += n + rng.randrange(1, 64)
    # one slot per size: shuffle only among equal sizes keeps every op inside its own slot
    by_size: dict[int, list[int]] = {}
    for n, s in zip(sizes, starts):
        by_size.setdefault(n, []).append(s)
    for slots in by_size.values():
        rng.shuffle(slots)
    dst_starts = [by_size[n].pop() for n in sizes]
    base_s, base_d = ctypes.addressof(src), ctypes.addressof(dst)
    return [(base_d + d, n, base_s + s) for d, n, s in zip(dst_starts, sizes, starts)]


def _expected(src, dst_size: int, ops, base_s: int, base_d: int) -> bytes:
    out = bytearray(b"\xee" * dst_size)
    raw = ctypes.string_at(src, len(src))
    for d, n, s in ops:
        out[d - base_d:d - base_d + n] = raw[s - base_s:s - base_s + n]
    return bytes(out)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("sizes", [[1 << 20] * 9, [4096, 65536 + 7, 1 << 20, 63, 0, (1 << 20) + 13] * 2,
                                   [PARALLEL_MIN_BYTES + 4097]])
def test_a_batch_lands_byte_for_byte_whatever_the_thread_split(threads, sizes):
    size = sum(sizes) + 64 * len(sizes) + 4096
    src, dst = _buffers(size, len(sizes))
    ops = _scattered_ops(src, dst, sizes, threads)
    want = _expected(src, size, ops, ctypes.addressof(src), ctypes.addressof(dst))
    copier = Copier(threads)
    try:
        copier.copy(ops)
    finally:
        copier.close()
    assert ctypes.string_at(dst, size) == want


@pytest.mark.parametrize("stream_min", [0, 1, 1 << 62])
def test_streamed_and_cached_copies_write_the_same_bytes(stream_min):
    size = (1 << 20) + 4096
    src, dst = _buffers(size, 7)
    ops = [(ctypes.addressof(dst) + 5 + i * 1000, n, ctypes.addressof(src) + 11 + i * 1000)
           for i, n in enumerate([1, 15, 16, 17, 63, 64, 65, 999])] + [(ctypes.addressof(dst) + 9000, 1 << 19,
                                                                        ctypes.addressof(src) + 9001)]
    want = _expected(src, size, ops, ctypes.addressof(src), ctypes.addressof(dst))
    copy_serial(ops, stream_min)
    assert ctypes.string_at(dst, size) == want


def test_without_the_c_helper_copies_fall_back_to_memmove(monkeypatch):
    monkeypatch.setattr(memcopy, "_fastcopy", None)  # as on a host that had no C compiler at install
    sizes = [1 << 20] * (PARALLEL_MIN_BYTES // (1 << 20) + 1)
    size = sum(sizes) + 64 * len(sizes) + 4096
    src, dst = _buffers(size, 3)
    ops = _scattered_ops(src, dst, sizes, 3)
    want = _expected(src, size, ops, ctypes.addressof(src), ctypes.addressof(dst))
    copier = Copier(2)
    assert not copier.streams
    try:
        copier.copy(ops)
    finally:
        copier.close()
    assert ctypes.string_at(dst, size) == want


def test_the_c_helper_is_built_where_a_compiler_is():
    # `pip install -e .` compiles it when a C compiler is present; without one kvcr falls back.
    if not any(shutil.which(cc) for cc in ("cc", "gcc", "clang")):
        pytest.skip("no C compiler on this host: the memmove fallback is tested above")
    assert memcopy._fastcopy is not None


@pytest.mark.parametrize("ops, problem", [([(1, 2)], "each op is"), ([(0, 1 << 20, 10)], "address 0"),
                                          (5, "sequence"), ([[8, -1, 16]], "non-negative"),
                                          ([(8, 1 << 63, 16)], "more than any buffer"), ([7], "each op is")])
def test_the_c_helper_refuses_malformed_ops_by_name(ops, problem):
    fast = pytest.importorskip("kvcr._fastcopy")
    with pytest.raises((TypeError, ValueError), match=problem):
        fast.copy(ops, 0)


def test_the_c_helper_takes_ops_as_lists_too():
    fast = pytest.importorskip("kvcr._fastcopy")
    src, dst = _buffers(4096, 5)
    fast.copy([[ctypes.addressof(dst), 4096, ctypes.addressof(src)]], 0)
    assert ctypes.string_at(dst, 4096) == ctypes.string_at(src, 4096)


@pytest.mark.parametrize("threads", [-1, 65])
def test_a_thread_count_out_of_range_is_refused(threads):
    with pytest.raises(ValueError, match="copy threads"):
        Copier(threads)
