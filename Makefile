# Fresh-machine entry points. `make test` is what CI runs (.ci/run); `make demo` is the main job.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: env test test-releases demo lint clean

env: $(VENV)/.ready

# torch is pinned to the CPU build first: a bare `torch` requirement would pull several GB of CUDA wheels.
$(VENV)/.ready: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) "torch==2.13.0"
	$(PIP) "megatron-core==0.15.3" "pytest>=7" numpy ruff setuptools matplotlib
	$(PIP) --no-deps --no-build-isolation -e .
	$(VENV)/bin/mcore-offload patch apply
	touch $@

lint: env
	$(VENV)/bin/ruff check mcore_offload tests benchmarks

# The C++ saved-tensor hooks are built (or found in the cache) before the tests, not inside the first test that
# needs them; where they cannot be built this prints why and the tests that need them skip.
test: env lint
	$(VENV)/bin/mcore-offload build-native || true
	$(PY) -m pytest -q -p no:cacheprovider

# The megatron-facing tests against the rest of pyproject's range, megatron-core 0.15.0-0.15.2, each release's wheel
# patched in a folder of its own (downloads the wheels; about 4 minutes). CI runs it after `test`.
test-releases: env
	bash .ci/other-releases.sh

demo: env
	$(VENV)/bin/mcore-offload plan --preset llama3-8b --pipeline-model-parallel-size 2 --seq-length 8192 \
	  --num-microbatches 8 --gpu h100
	$(VENV)/bin/torchrun --nproc-per-node 1 benchmarks/cpu_launch.py --transformer-impl local \
	  --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --vocab-size 256 \
	  --micro-batch-size 2 --num-microbatches 2 --train-iters 3 \
	  --fine-grained-activation-offloading --offload-modules qkv_linear core_attn attn_proj \
	  --min-offloaded-tensor-size 1024

clean:
	rm -rf $(VENV)
