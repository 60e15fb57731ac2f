"""Config decoding (TOML and JSON), sizes, layouts and refusals that name the key."""

import json

import pytest

from kvcr.config import ConfigError, load_config, parse_size
from kvcr.proto.pool import PageSizeError
from kvcr.runner import Runner, UnknownPool, plan_layout

TOML = """
[runner]
name = "t"
block_size = 32
[dram]
size = "8Mi"
[[dram.pools]]
name = "kv"
page_bytes = "256Ki"
[[dram.pools]]
name = "mamba"
page_bytes = 6000
size = "1Mi"
"""


@pytest.mark.parametrize("raw,expected", [(4096, 4096), ("64Ki", 65536), ("8Gi", 8 << 30), ("1.5G", 1_500_000_000),
                                          ("256 MiB", 256 << 20), ("10k", 10_000)])
def test_sizes_accept_integers_and_suffixes(raw, expected):
    assert parse_size("k", raw) == expected


@pytest.mark.parametrize("raw", ["", "lots", "-1", "1Xi", True, 1.5, None])
def test_bad_sizes_name_the_key(raw):
    with pytest.raises(ConfigError, match="dram.size"):
        parse_size("dram.size", raw)


def test_toml_and_json_give_the_same_config(tmp_path):
    import tomllib
    (tmp_path / "c.toml").write_text(TOML)
    (tmp_path / "c.json").write_text(json.dumps(tomllib.loads(TOML)))
    a, b = load_config(tmp_path / "c.toml"), load_config(tmp_path / "c.json")
    assert a == b and a.pool_sizes() == {"kv": 7 << 20, "mamba": 1 << 20}


def test_side_pools_get_their_own_aligned_slots(tmp_path):
    (tmp_path / "c.toml").write_text(TOML)
    layouts = {p.name: p for p in plan_layout(load_config(tmp_path / "c.toml"))}
    assert layouts["kv"].num_slots == 28 and layouts["mamba"].stride == 8192
    assert layouts["mamba"].offset % 4096 == 0 and layouts["mamba"].num_slots == 128
    assert layouts["kv"].namespace.digest != layouts["mamba"].namespace.digest


@pytest.mark.parametrize("text,problem", [
    ("[runner\n", "not valid TOML"),
    ("[runner]\nblock_size = 0\n", "runner.block_size = 0 must be >= 1"),
    ("[runner]\ncopy_threads = 65\n", "runner.copy_threads = 65 must be in 0..64"),
    ("[runner]\nreply_spin_us = -1\n", "runner.reply_spin_us = -1 must be in 0..100000"),
    ("[runner]\ninline_pull_bytes = \"65Mi\"\n", "runner.inline_pull_bytes = 68157440 must be in 0..67108864"),
    ("[runner]\nreach_probe_s = -0.5\n", "runner.reach_probe_s = -0.5 must be in 0..60"),
    ("[dram]\nlow_watermark = 0.9\nhigh_watermark = 0.5\n", "need 0 < low <= high <= 1"),
    ("[dram]\nmax_claim_fraction = 0\n", "dram.max_claim_fraction"),
    ("[dram]\nalignment = 3000\n", "dram.alignment = 3000 must be a power of two"),
    ("[dram]\nsize = \"1Mi\"\n[[dram.pools]]\npage_bytes = \"2Mi\"\n", "less than one page"),
    ("[[dram.pools]]\nname = \"a b\"\n", "may use only letters"),
    ("[[dram.pools]]\nname = \"kv\"\n[[dram.pools]]\nname = \"kv\"\n", "duplicate name"),
    ("[events]\nevent_format = \"fancy\"\n", "events.event_format = 'fancy'"),
    ("[events]\nheartbeat_s = -1\n", "events.heartbeat_s"),
    ("[namespace]\nmodel = \"\"\n", "namespace.model"),
    ("dram = 5\n", "dram must be a table"),
    ("[dram]\npools = 3\n", "dram.pools = 3 must be a list"),
    ("[dram]\nlock_memory = \"yes\"\n", "dram.lock_memory = 'yes' must be true or false"),
    ("[runner]\ndp_size = 0\n", "runner.dp_size = 0 must be >= 1"),
    ("[runner]\ndp_size = 2\ndp_rank = 2\n", "above runner.dp_rank = 2"),
    ("[runner]\nadvertise_host = \"0.0.0.0\"\n", "runner.advertise_host = '0.0.0.0' must be a host name"),
    ("[runner]\nadvertise_host = \"http://h\"\n", "runner.advertise_host = 'http://h'"),
    ("[runner]\nadvertise_host = \"[fd00::1\"\n", "runner.advertise_host = '[fd00::1'"),
])
def test_bad_config_is_refused_naming_the_key(tmp_path, text, problem):
    (tmp_path / "c.toml").write_text(text)
    with pytest.raises(ConfigError, match=problem.replace("(", r"\(").replace("[", r"\[")):
        load_config(tmp_path / "c.toml")


@pytest.fixture
def runner():
    r = Runner(load_config(None, {"runner.name": "cfg-test", "dram.size": "2Mi",
                                  "dram.pools": [{"name": "kv", "page_bytes": 4096}]}))
    yield r
    r.shutdown()


@pytest.mark.parametrize("size,problem", [(4097, "page 0 for pool 'kv' is 4097 bytes; the pool's page size is 4096"),
                                          (100, "page 0 for pool 'kv' is 100 bytes")])
def test_oversized_and_truncated_pages_are_refused_and_nothing_is_lost(runner, size, problem):
    key = runner.key("kv", "a" * 64)
    runner.put("kv", [key], [b"\x01" * 4096])
    with pytest.raises(PageSizeError, match=problem):
        runner.put("kv", [runner.key("kv", "b" * 64)], [b"\x02" * size])
    assert runner.get("kv", [key]) == [b"\x01" * 4096]
    assert runner.pools["kv"].statistics().num_filling == 0


def test_keys_and_pages_must_pair_up_and_pools_must_exist(runner):
    with pytest.raises(PageSizeError, match="2 keys but 1 pages"):
        runner.put("kv", ["x", "y"], [b"\x00" * 4096])
    with pytest.raises(UnknownPool, match="unknown pool 'nope'; this runner has \\['kv'\\]"):
        runner.lookup("nope", [])
