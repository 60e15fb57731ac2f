"""The ctypes RMA binding: struct layouts checked against the shipped ucp.h, and real GETs."""

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from kvcr.drivers import ucx_rma
from kvcr.proto.pull import GetOp, delivered_prefix, plan_gets, plan_segment_gets

LAYOUT_PROBE = r"""
#include <stddef.h>
#include <stdio.h>
#include <ucp/api/ucp.h>
int main(void) {
    printf("%zu %zu %zu %zu %zu %d %d %d %d %d %d %zu %zu %d %d %d %d %zu\n",
           offsetof(ucp_mem_map_params_t, field_mask), offsetof(ucp_mem_map_params_t, address),
           offsetof(ucp_mem_map_params_t, length), sizeof(ucp_mem_map_params_t),
           sizeof(ucp_request_param_t), (int)offsetof(ucp_request_param_t, op_attr_mask),
           (int)UCP_MEM_MAP_PARAM_FIELD_ADDRESS, (int)UCP_MEM_MAP_PARAM_FIELD_LENGTH,
           (int)UCS_INPROGRESS, (int)UCS_ERR_LAST, UCP_API_MINOR,
           offsetof(ucp_mem_map_params_t, flags), offsetof(ucp_mem_map_params_t, prot),
           (int)UCP_MEM_MAP_PARAM_FIELD_PROT, (int)UCP_MEM_MAP_PROT_LOCAL_READ,
           (int)UCP_MEM_MAP_PROT_LOCAL_WRITE, (int)UCP_MEM_MAP_PROT_REMOTE_READ, sizeof(ucs_status_t));
    return 0;
}
"""


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to read ucp.h")
def test_struct_layout_and_constants_match_the_shipped_ucp_header(tmp_path):
    import libucx
    include = Path(libucx.__file__).parent / "include"
    (tmp_path / "probe.c").write_text(LAYOUT_PROBE)
    subprocess.run(["gcc", "-I", str(include), str(tmp_path / "probe.c"), "-o", str(tmp_path / "probe")],
                   check=True, capture_output=True)
    out = subprocess.run([str(tmp_path / "probe")], check=True, capture_output=True, text=True).stdout.split()
    (mask, address, length, params_size, request_size, op_attr, f_addr, f_len, inprogress, err_last,
     minor, flags, prot, f_prot, local_read, local_write, remote_read, status_size) = map(int, out)
    assert (mask, address, length) == (0, 8, 16)
    assert (flags, prot) == (ucx_rma._MemMapParams.flags.offset, ucx_rma._MemMapParams.prot.offset)
    assert (f_prot, local_read, local_write, remote_read) == (ucx_rma.MEM_MAP_FIELD_PROT, ucx_rma.PROT_LOCAL_READ,
                                                              ucx_rma.PROT_LOCAL_WRITE, ucx_rma.PROT_REMOTE_READ)
    assert status_size == ctypes.sizeof(ctypes.c_int8)  # a packed enum: statuses are read as int8
    assert ctypes.sizeof(ucx_rma._MemMapParams) >= params_size
    assert ucx_rma.REQUEST_PARAM_BYTES >= request_size and op_attr == 0
    assert (f_addr, f_len) == (ucx_rma.MEM_MAP_FIELD_ADDRESS, ucx_rma.MEM_MAP_FIELD_LENGTH)
    assert (inprogress, err_last) == (ucx_rma.UCS_INPROGRESS, ucx_rma.UCS_ERR_LAST)
    assert (ucx_rma.TESTED_UCX[1]) == minor


def test_the_loaded_ucx_is_the_tested_one_and_others_are_refused(monkeypatch):
    assert ucx_rma.check_version()[:2] == ucx_rma.TESTED_UCX
    monkeypatch.setattr(ucx_rma, "ucx_version", lambda: (1, 19, 0))  # stand-in: no second UCX build here
    with pytest.raises(ucx_rma.UcxVersionError, match="UCX 1.19.0 is loaded, but kvcr's RMA binding is tested "
                                                      "with UCX 1.21 only"):
        ucx_rma.check_version()


def test_gets_between_two_workers_deliver_exact_bytes_and_coalesce():
    from kvcr.drivers.ucx_plane import UcxPlane

    source, dest = UcxPlane(), UcxPlane(progress_thread=False)
    try:
        page = 4096
        region = ctypes.create_string_buffer(bytes(range(256)) * (64 * page // 256))
        source.register_region(ctypes.addressof(region), 64 * page, chunk=16 * page).join()
        assert source.registered_bytes == 64 * page and len(source.chunks) == 4
        out = ctypes.create_string_buffer(b"\xee" * (64 * page))
        chunks = [(c.offset, c.length) for c in source.chunks]
        ops = plan_gets([ctypes.addressof(out) + i * page for i in range(64)], [i * page for i in range(64)], page,
                        chunks=chunks)
        assert len(ops) == 4  # adjacent pages merged, never across a registered chunk
        result = dest.get(source.address, {c.offset: c.rkey for c in source.chunks}, ctypes.addressof(region),
                          [(op.local, op.nbytes, op.remote_offset) for op in ops], timeout_s=5, abandon_s=1)
        assert all(result.done) and not result.error
        assert out.raw[:64 * page] == region.raw[:64 * page]
    finally:
        dest.close()
        source.close()


@pytest.mark.parametrize("done,live,expected", [
    ([True, True], (True,) * 4, 4), ([True, False], (True,) * 4, 2), ([False, True], (True,) * 4, 0),
    ([True, True], (True, True, False, True), 2), ([True, True], (), 0)])
def test_only_leading_pages_that_arrived_and_stayed_live_are_delivered(done, live, expected):
    ops = [GetOp(0, 2, 0, (0, 1)), GetOp(2, 2, 2, (2, 3))]
    assert delivered_prefix(ops, done, live, 4) == expected


@pytest.mark.parametrize("done,expected", [([True] * 4, 2), ([True, False, True, True], 0),
                                            ([True, True, True, False], 1)])
def test_a_page_split_in_segments_is_delivered_only_when_every_segment_arrived(done, expected):
    # Two pages, each K then V in separate host buffers; the source holds each page contiguously.
    k, v = 1 << 20, 2 << 20
    ops = plan_segment_gets([(k, v), (k + 100, v + 100)], [0, 200], (100, 100), chunks=[(0, 1 << 20)])
    assert [(op.local, op.nbytes, op.remote_offset, op.pages) for op in ops] == [
        (k, 100, 0, (0,)), (v, 100, 100, (0,)), (k + 100, 100, 200, (1,)), (v + 100, 100, 300, (1,))]
    assert delivered_prefix(ops, done, (True, True), 2) == expected
    merged = plan_segment_gets([(k, k + 100), (k + 200, k + 300)], [0, 200], (100, 100), chunks=[(0, 1 << 20)])
    assert [(op.nbytes, op.pages) for op in merged] == [(400, (0, 1))]  # contiguous on both sides: one GET


@pytest.mark.parametrize("lanes", [1, 2])
def test_a_large_pull_split_over_lanes_delivers_the_same_bytes(lanes):
    from kvcr.drivers.ucx_plane import UcxPlane

    source, dest = UcxPlane(), UcxPlane(progress_thread=False, lanes=lanes)
    try:
        size = 12 << 20
        region = ctypes.create_string_buffer(size)
        ctypes.memmove(region, (bytes(range(256)) * (size // 256)), size)
        source.register_region(ctypes.addressof(region), size).join()
        out = ctypes.create_string_buffer(size)
        ops = [(ctypes.addressof(out), 8 << 20, 0), (ctypes.addressof(out) + (8 << 20), 4 << 20, 8 << 20)]
        result = dest.get(source.address, {c.offset: c.rkey for c in source.chunks}, ctypes.addressof(region), ops,
                          timeout_s=10, abandon_s=1)
        assert result.done == (True, True) and out.raw[:size] == region.raw[:size]
    finally:
        dest.close()
        source.close()
