"""Every hash vector computed by the real SGLang, vLLM and Dynamo implementations."""

import hashlib
import shutil
from pathlib import Path

import pytest

from kvcr.proto import keys, tokenhash
from tests.helpers import vectors

pytestmark = pytest.mark.pure


@pytest.mark.parametrize("v", vectors("sglang_page_sha256_chain"))
def test_sglang_page_chain_matches_engine(v):
    i = v["inputs"]
    assert keys.page_hashes(i["token_ids"], i["page_size"], i["prior_hash"]) == v["expected"]["page_hashes_hex"]


@pytest.mark.parametrize("v", vectors("sglang_hash_str_to_int64"))
def test_sglang_event_int64_is_first_eight_bytes(v):
    got = [keys.hash_str_to_int64(h) for h in v["inputs"]["page_hashes_hex"]]
    assert got == v["expected"]["event_block_hashes_int64"]
    assert [hex(keys.to_u64(x)) for x in got] == v["expected"]["as_u64_hex"]


@pytest.mark.parametrize("v", vectors("sglang_storage_namespace_chain"))
def test_sglang_namespaced_storage_chain(v):
    i, e = v["inputs"], v["expected"]
    assert keys.storage_namespace_seed(i["extra_key"], i["cache_salt"]).hex() == e["namespace_seed_hex"]
    got = keys.request_page_hashes(i["token_ids"], i["page_size"], extra_key=i["extra_key"],
                                   cache_salt=i["cache_salt"])
    assert got == e["page_hashes_hex"]


@pytest.mark.parametrize("v", vectors("sglang_event_hash_with_namespace"))
@pytest.mark.parametrize("fmt,expected_key", [("dynamo", "dynamo_format"),
                                              ("default", "default_format_when_extra_key_is_a_known_lora")])
def test_sglang_published_event_hash(v, fmt, expected_key):
    i, e = v["inputs"], v["expected"]
    chain = keys.page_digests(i["token_ids"], i["page_size"],
                              keys.event_salt_seed(i["cache_salt"]) if i["cache_salt"] else None)
    assert [d.hex() for d in chain] == e["event_chain_hex"]
    seed = keys.event_namespace_seed(i["extra_key"], i["cache_salt"], fmt)
    assert (seed.hex() if seed else None) == e[expected_key]["namespace_seed_hex"]
    got = keys.event_hashes(i["token_ids"], i["page_size"], extra_key=i["extra_key"], cache_salt=i["cache_salt"],
                            event_format=fmt)
    assert got == e[expected_key]["published_block_hashes"]


@pytest.mark.parametrize("v", vectors("sglang_event_salt_seed"))
def test_sglang_event_salt_seed(v):
    assert keys.event_salt_seed(v["inputs"]["cache_salt"]).hex() == v["expected"]["prior_hash_hex"]


@pytest.mark.parametrize("v", vectors("vllm_"))
def test_vllm_block_chain(v):
    i, e = v["inputs"], v["expected"]
    if "object" in i:  # the raw CBOR bytes of block 0
        payload = tokenhash.cbor((tokenhash.vllm_none_hash("sha256_cbor"), tuple(range(16)), None))
        assert payload.hex() == e["cbor_hex"]
        assert hashlib.sha256(payload).hexdigest() == e["sha256_hex"]
        return
    extra = [tuple(tuple(x) for x in k) if k else None for k in i["extra_keys"]]
    digests = tokenhash.vllm_block_hashes(i["blocks"], algo=i["prefix_caching_hash_algo"], extra_keys=extra)
    if "block_hashes_hex" in e:
        assert [d.hex() for d in digests] == e["block_hashes_hex"]
    assert [tokenhash.vllm_event_int(d) for d in digests] == e["event_block_hashes_u64"]


@pytest.mark.parametrize("v", vectors("dynamo_"))
def test_dynamo_local_block_hash(v):
    i, e = v["inputs"], v["expected"]
    if "bytes_utf8" in i:
        import xxhash
        assert xxhash.xxh3_64_intdigest(i["bytes_utf8"].encode(), seed=i["seed"]) == e["u64"]
        return
    got = tokenhash.dynamo_local_block_hashes(i["token_ids"], i["kv_block_size"], lora_name=i.get("lora_name"),
                                              cache_namespace=i.get("cache_namespace"), eagle=i.get("is_eagle", False))
    assert got == e["local_block_hashes_u64"]


@pytest.mark.parametrize("v", [p for p in vectors("dynamo_") if "token_ids" in p.values[0]["inputs"]
                               and not p.values[0]["inputs"].get("is_eagle")])
def test_dynamo_block_sequence_hashes_chain_the_vectors_local_hashes(v, hash_and_index_loops):
    i, e = v["inputs"], v["expected"]
    got = tokenhash.dynamo_block_sequence_hashes(i["token_ids"], i["kv_block_size"], lora_name=i.get("lora_name"),
                                                 cache_namespace=i.get("cache_namespace"))
    assert got == tokenhash.dynamo_sequence_hashes(e["local_block_hashes_u64"])


@pytest.mark.parametrize("cut", [0, 16, 48, 64])
def test_dynamo_block_sequence_hashes_continue_from_a_parent(cut, hash_and_index_loops):
    tokens = list(range(1000, 1000 + 64 + 5))  # 4 blocks and a partial one, which is not hashed
    whole = tokenhash.dynamo_block_sequence_hashes(tokens, 16, cache_namespace="tenant-a")
    head = whole[:cut // 16]
    tail = tokenhash.dynamo_block_sequence_hashes(tokens[cut:], 16, cache_namespace="tenant-a",
                                                  parent=head[-1] if head else None)
    assert len(whole) == 4 and head + tail == whole
    assert whole[1] == tokenhash.dynamo_chain_hash(whole[0], tokenhash.dynamo_local_block_hashes(
        tokens[16:32], 16, cache_namespace="tenant-a")[0])


def test_the_c_token_hash_is_built_where_a_compiler_and_xxhash_header_are():
    if not shutil.which("gcc") or not Path("/usr/include/xxhash.h").exists():
        pytest.skip("no gcc or no xxhash header on this host: the Python hashes are tested above")
    assert tokenhash._native is not None


def test_dynamo_sequence_hash_and_salt_seeds():
    local = tokenhash.dynamo_local_block_hashes(list(range(32)), 16)
    assert tokenhash.dynamo_sequence_hashes(local)[1] == 13769157705258532664
    assert tokenhash.dynamo_seed(lora_name="adapter-a") == 8842669519798868182
    assert tokenhash.dynamo_seed(cache_namespace="tenant-a") == 1948188790972764086


def test_router_view_of_a_page_key_is_its_first_16_hex_digits():
    page = "5d85718ec594b982c252d0279e5966ffca33a5eaf2a455038d3ab331fde70cea"
    assert keys.router_u64(page) == 0x5d85718ec594b982
    assert keys.router_u64("f" * 64) == (1 << 64) - 1 and keys.hash_str_to_int64("f" * 64) == -1


@pytest.mark.parametrize("field,value,other", [("model", "a", "b"), ("tp_rank", 0, 1), ("dtype", "float16", "bfloat16"),
                                                ("layout", "page_first", "layer_first"), ("page_size", 16, 32),
                                                ("components", (("kv", 1),), (("kv", 2),))])
def test_namespace_separates_every_field(field, value, other):
    base = {"model": "m", "tp_size": 2}
    a = keys.Namespace(**{**base, field: value})
    b = keys.Namespace(**{**base, field: other})
    assert a.digest != b.digest
    assert any(d.startswith(field.split("_")[0]) for d in a.differences(b))


def test_mla_ranks_share_a_namespace():
    assert keys.Namespace(model="m", tp_size=2, tp_rank=0, is_mla=True).digest == \
        keys.Namespace(model="m", tp_size=2, tp_rank=1, is_mla=True).digest


@pytest.mark.parametrize("bad", ["", "abc", "g" * 64, "A" * 64, "../" + "a" * 61, "a" * 31 + "\n" + "a" * 32, 7])
@pytest.mark.parametrize("one", [True, False], ids=["storage_key", "storage_keys"])
def test_storage_key_rejects_non_hex_page_hashes(bad, one):
    with pytest.raises(keys.KeyFormatError, match="64 lowercase hex"):
        keys.storage_key(bad, "ns") if one else keys.storage_keys(["b" * 64, bad, "c" * 64], "ns")


def test_storage_keys_are_each_page_hash_in_the_namespace():
    hexes = ["0123456789abcdef" * 4, "f" * 64]
    assert keys.storage_keys(hexes, "ns") == [keys.storage_key(h, "ns") for h in hexes]
    assert keys.storage_keys([], "ns") == []


def test_context_parallel_ranks_get_their_own_namespace_and_cp_1_keeps_old_digests():
    from kvcr.proto.keys import Namespace

    plain = Namespace(model="m")
    assert "cp" not in plain.fields()
    ranks = [Namespace(model="m", cp_size=2, cp_rank=r) for r in (0, 1)]
    assert len({plain.digest, *(n.digest for n in ranks)}) == 3
