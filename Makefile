# Two entry points: `make demo` (set up, then run the main job) and `make test` (set up, then test).
PYTHON ?= python3
VENV ?= .venv
DYNAMO_VENV ?= .venv-dynamo
PIP := $(VENV)/bin/pip --disable-pip-version-check -q
# Real SGLang classes for the interop tests, installed the CPU way (shared/reference recipe):
# torch pinned to the local CPU build so pip never resolves a multi-GB CUDA torch.
TORCH := torch==2.13.0
SGLANG := sglang==0.5.23
SGLANG_DEPS := numpy orjson psutil pybase64 requests packaging pillow triton==3.9.0 starlette msgspec \
	pydantic tqdm ipython aiohttp
# Host pools, the cache controller and the scheduler import these too (tests install a torchvision stub instead of
# torchvision, whose wheels need CUDA); the last four go in without their heavy dependencies.
SGLANG_POOL_DEPS := transformers==5.19.0 dill loguru setproctitle==1.3.8 openai==3.57.0 partial-json-parser==0.2.1.1.post7 \
	einops==0.8.2 uvicorn==0.54.0 fastapi==0.165.0
SGLANG_NODEPS := apache-tvm-ffi==0.1.11 sentencepiece==0.2.1 compressed-tensors==0.18.0 gguf
# A live `sglang.launch_server` (the live tests, `kvcr demo --engine sglang`): its HTTP server,
# tokenizer manager and scheduler import these too.
SGLANG_SERVER_DEPS := pyzmq uvloop==0.23.0 python-multipart==0.0.34 prometheus-client jsonschema xgrammar==0.2.9 \
	soundfile
# SGLang's own benchmark client (`python -m sglang.benchmark.serving`): its dataset package imports
# Hugging Face's datasets at load, whatever the dataset.
SGLANG_CLIENT_DEPS := datasets==5.2.0

.PHONY: demo test test-pure setup sglang-setup sglang-releases dynamo-setup native-deps system-deps dynamo-system-deps bench bench-deps fuzz clean

# kvcr's C token hash (setup.py) includes xxhash's header; where it cannot be installed the
# hashes stay in Python, so this step never fails the build.
native-deps:
	@test -e /usr/include/xxhash.h || { \
		sudo=$$( [ "$$(id -u)" -eq 0 ] || echo sudo ); \
		$$sudo apt-get update -qq && $$sudo apt-get install -y -qq libxxhash-dev; } \
		|| echo "libxxhash-dev not installed: kvcr hashes tokens in Python"

# torch is named in the same install so pip keeps the CPU build instead of resolving another one.
$(VENV)/.installed: pyproject.toml setup.py kvcr/_fastcopy.c kvcr/_tokenhash.c router_hints/_inventory.c | native-deps
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -e '.[test,demo]' '$(TORCH)'
	touch $@

# SGLang builds its page-hash extension on first use: g++, ninja and the OpenSSL headers. The
# test hosts' packet loss is made with nftables, their delay and reordering with iptables' NFQUEUE (tests/netns.py).
system-deps:
	@command -v g++ >/dev/null && command -v ninja >/dev/null && test -e /usr/include/openssl/sha.h \
		&& command -v nft >/dev/null && command -v iptables >/dev/null || { \
		sudo=$$( [ "$$(id -u)" -eq 0 ] || echo sudo ); \
		$$sudo apt-get update -qq && $$sudo apt-get install -y -qq g++ ninja-build libssl-dev nftables iptables; }

$(VENV)/.sglang: $(VENV)/.installed | system-deps
	$(PIP) install '$(TORCH)'
	$(PIP) download --no-deps '$(SGLANG)' -d $(VENV)/wheels
	$(PIP) install --no-deps $(VENV)/wheels/sglang-0.5.23-*.whl
	$(PIP) install $(SGLANG_DEPS) $(SGLANG_POOL_DEPS) $(SGLANG_SERVER_DEPS) $(SGLANG_CLIENT_DEPS) '$(TORCH)'
	$(PIP) install --no-deps $(SGLANG_NODEPS)
	touch $@

# The two releases before SGLANG (ai-dynamo 1.6.1 pins sglang 0.5.21): an environment each that holds
# only the release's own wheel and reads everything else (torch, transformers, kvcr) from $(VENV),
# added after its own site-packages by a .pth file. tests/sglang_live/test_releases.py runs them.
SGLANG_OLDER := 0.5.21 0.5.22
$(VENV)-sglang-%/.installed: $(VENV)/.sglang
	$(PYTHON) -m venv $(VENV)-sglang-$*
	base=$$($(VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	own=$$($(VENV)-sglang-$*/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	echo "import site; site.addsitedir('$$base')" > $$own/zz-kvcr-base.pth
	$(VENV)-sglang-$*/bin/pip --disable-pip-version-check -q install --no-deps 'sglang==$*'
	touch $@

# Dynamo's runtime pins its own pydantic, so its indexer, frontend and our bridge (kvcr.dynamo) live in
# a separate environment. ai-dynamo 1.6.1 requires `aisimulate`, a placeholder no index serves: its
# wheel goes in without dependencies and its other requirements are named here (what the frontend,
# the router and the bindings import); kvcr goes in without torch, UCX or SGLang.
DYNAMO_PIP := $(DYNAMO_VENV)/bin/pip --disable-pip-version-check -q
DYNAMO_DEPS := 'ai-dynamo-runtime==1.6.1' 'aiohttp>=3.14.3,<4' 'certifi>=2026.10.19' 'kubernetes>=32.0.1,<33' \
	'msgspec>=0.19' 'prometheus-client>=0.23.1,<1' 'pyzmq>=26' 'redis>=6.2,<9' tqdm 'transformers>=4.56' \
	'zstandard>=0.23,<1' msgpack xxhash
# Dynamo's discovery across hosts is etcd: the tests start Debian's etcd-server (3.4, which Dynamo
# 1.6.1's client speaks) themselves.
dynamo-system-deps:
	@command -v etcd >/dev/null || { \
		sudo=$$( [ "$$(id -u)" -eq 0 ] || echo sudo ); \
		$$sudo apt-get update -qq && $$sudo apt-get install -y -qq etcd-server; }

$(DYNAMO_VENV)/.installed: pyproject.toml setup.py | dynamo-system-deps native-deps
	$(PYTHON) -m venv $(DYNAMO_VENV)
	$(DYNAMO_PIP) download --no-deps 'ai-dynamo==1.6.1' -d $(DYNAMO_VENV)/wheels
	$(DYNAMO_PIP) install --no-deps $(DYNAMO_VENV)/wheels/ai_dynamo-1.6.1-*.whl
	$(DYNAMO_PIP) install $(DYNAMO_DEPS)
	$(DYNAMO_PIP) install --no-deps -e .
	touch $@

setup: $(VENV)/.installed
sglang-setup: $(VENV)/.sglang
sglang-releases: $(foreach v,$(SGLANG_OLDER),$(VENV)-sglang-$(v)/.installed)
dynamo-setup: $(DYNAMO_VENV)/.installed

demo: setup
	$(VENV)/bin/kvcr demo

# SGLang builds its page-hash extension once (g++, ninja, OpenSSL headers); keep it with the venv.
test: setup sglang-setup sglang-releases dynamo-setup
	TORCH_EXTENSIONS_DIR=$(abspath $(VENV))/torch-extensions KVCR_DYNAMO_PYTHON=$(abspath $(DYNAMO_VENV))/bin/python \
		$(VENV)/bin/pytest -q $(PYTEST_ARGS)

# The quick inner loop: the decisions alone (tests marked `pure`: no process, no socket), in seconds.
test-pure: setup
	$(VENV)/bin/pytest -q -m pure $(PYTEST_ARGS)

# Mooncake's non-CUDA wheel links libibverbs at import (no RDMA device is needed).
bench-deps:
	@test -e /usr/lib/x86_64-linux-gnu/libibverbs.so.1 || { \
		sudo=$$( [ "$$(id -u)" -eq 0 ] || echo sudo ); \
		$$sudo apt-get update -qq && $$sudo apt-get install -y -qq libibverbs1; }

bench: sglang-setup dynamo-setup | bench-deps
	$(VENV)/bin/python bench/dram_pool.py
	$(VENV)/bin/python bench/nvme.py
	$(VENV)/bin/python bench/peer_pull.py
	$(VENV)/bin/python bench/vs_nvidia_kvcr.py
	$(VENV)/bin/python bench/vs_mooncake.py
	KVCR_DYNAMO_PYTHON=$(abspath $(DYNAMO_VENV))/bin/python $(VENV)/bin/python bench/router_index.py
	$(VENV)/bin/python bench/router_overhead.py
	$(VENV)/bin/python bench/nvme_persist.py
	$(VENV)/bin/python bench/replay_study.py
	KVCR_DYNAMO_PYTHON=$(abspath $(DYNAMO_VENV))/bin/python $(VENV)/bin/python bench/dynamo_frontend.py
	$(VENV)/bin/python bench/sglang_adapter.py
	TORCH_EXTENSIONS_DIR=$(abspath $(VENV))/torch-extensions $(VENV)/bin/python bench/sglang_live.py
	TORCH_EXTENSIONS_DIR=$(abspath $(VENV))/torch-extensions $(VENV)/bin/python bench/vs_sglang_router.py
	$(PIP) install py-spy
	TORCH_EXTENSIONS_DIR=$(abspath $(VENV))/torch-extensions $(VENV)/bin/python bench/sglang_live_profile.py
	$(VENV)/bin/python bench/pull_breakdown.py --py-spy

# Coverage-guided campaigns over every decoder of outside input (tests/fuzz/); their corpora are
# replayed by the suite. FUZZ_SECONDS per target.
FUZZ_SECONDS ?= 60
fuzz: setup
	$(PIP) install atheris==3.0.0
	$(VENV)/bin/python -m tests.fuzz.campaign --seconds $(FUZZ_SECONDS)

clean:
	rm -rf $(VENV) $(foreach v,$(SGLANG_OLDER),$(VENV)-sglang-$(v)) $(DYNAMO_VENV) .venv-kvcr-ref .venv-mooncake build *.egg-info
