# Two commands do all set-up on a fresh machine: `make test` and `make demo`.
# The environment (.venv) is created on first use from requirements.lock with uv.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test test-fast test-slow test-unit test-functional test-numerics test-compat demo convergence convergence-range bench gpu-check venv lock clean

# Two test processes (pytest-xdist): a test's ranks wait for each other in collectives, and the other
# process's test fills those waits (docs/testing.md, "Two test processes"). TEST_PROCESSES=0 runs the
# tests in pytest's own process (for -x, --pdb); tests/worker_groups.py keeps a module's tests that
# share a module fixture in one process. Units go in collection order (the functional tests, the
# longest, first), the order `--dist load` ran fastest in (one run each), not xdist's default of the largest groups first.
TEST_PROCESSES ?= 2
XDIST := -n $(TEST_PROCESSES) --dist loadgroup --no-loadscope-reorder

test: $(STAMP)
	$(PY) -m pytest tests -q -m "not slow" --durations=20 $(XDIST)

# The loop while you work: the in-process tier, no worker ranks and no process started (tests/tiers.py
# marks the others `multirank` and `subprocess` from their code). Fails if it left a library module unimported.
test-fast: $(STAMP)
	$(PY) -m pytest tests -q -m "not multirank and not subprocess and not slow" --require-library-imported

# Fault-injection runs of other layouts and of kills during saves (docs/reliability.md): minutes each.
test-slow: $(STAMP)
	$(PY) -m pytest tests -q -m slow

# make test's tests under kernel settings that round differently from this CPU's default build (the
# code paths of other CPUs; docs/reliability.md). Each setting first says whether it changes the bits
# of a product here. As long as `make test` for each setting; not part of CI.
# make test runs emerging_optimizers' compiled updates eagerly (tests/conftest.py); the AVX2 setting
# compiles them (TORCH_COMPILE_DISABLE=0). torch 2.13's inductor emits vector code that does not
# compile under ATEN_CPU_CAPABILITY=default, so that setting runs them eagerly (TORCH_COMPILE_DISABLE=1).
NUMERICS_SETTINGS := "ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=COMPATIBLE TORCH_COMPILE_DISABLE=0" \
	"ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=AVX2 TORCH_COMPILE_DISABLE=1"
# Each setting compiles into a cache of its own: inductor's shared cache would hand a setting kernels
# compiled for another instruction set (measured: garbage in Lion's, SOAP's and PSGD-Pro's steps).
test-numerics: $(STAMP)
	@failed=0; for setting in $(NUMERICS_SETTINGS); do \
	  echo "== $$setting"; cache=$$(mktemp -d); \
	  env $$setting $(PY) tools/rounding_probe.py && \
	  env $$setting TORCHINDUCTOR_CACHE_DIR=$$cache $(PY) -m pytest tests -q -m "not slow" -p no:cacheprovider $(XDIST) || failed=1; \
	  rm -rf $$cache; \
	done; exit $$failed

# The fast tier, the FSDP2 and the layer-wise tests on the oldest torch pyproject.toml allows and on the
# newest one tested (a venv each, .venv-torch-VERSION, from requirements.lock with that torch). Not part of CI.
COMPAT_TORCH := 2.9.0 2.15.0
COMPAT_TESTS := tests/unit/library/distributed/test_fsdp2.py tests/unit/library/distributed/test_layer_wise.py \
	tests/unit/library/distributed/test_layer_wise_gpt.py tests/unit/library/checkpointing/test_checkpoint_fsdp2.py
test-compat:
	@failed=0; for version in $(COMPAT_TORCH); do \
	  tools/compat_venv.sh $$version || exit 1; echo "== torch $$version"; \
	  .venv-torch-$$version/bin/python -m pytest tests -q -p no:cacheprovider \
	    -m "not multirank and not subprocess and not slow" --require-library-imported || failed=1; \
	  .venv-torch-$$version/bin/python -m pytest $(COMPAT_TESTS) -q -p no:cacheprovider -m "not slow" || failed=1; \
	done; exit $$failed

test-unit: $(STAMP)
	$(PY) -m pytest tests/unit -q -m "not slow" $(XDIST)

test-functional: $(STAMP)
	$(PY) -m pytest tests/functional -q -m "not slow" $(XDIST)

demo: $(STAMP)
	$(PY) scripts/demo.py

# Muon against AdamW on real text: lr sweeps, 3 seeds, Muon variants (about an hour on 2 CPU cores;
# resumes where it stopped). Writes benchmarks/results/convergence/ and the table and plot of
# docs/convergence.md. Not part of `make test`.
convergence: $(STAMP)
	$(PY) benchmarks/convergence.py --docs

# Muon's advantage as a range: 3 corpora, a 4x larger model, a 3x longer budget, AdamW swept over
# lr x beta2 x warm-up and weight decay, whole schedules at 4 budgets x 3 seeds (docs/convergence.md).
# CPU-hours: runs one at a time per CPU and resumes where it stopped; `--cells KEY` runs one cell.
convergence-range: $(STAMP)
	$(PY) benchmarks/convergence_range.py --docs

# Prints each benchmark's table and a summary; JSON under benchmarks/results/ (git-ignored).
bench: $(STAMP)
	$(PY) benchmarks/run_all.py

# On a machine with one CUDA GPU: the GPU-tier tests, Newton-Schulz vs matmul TFLOP/s (bf16, fp32),
# Muon / fused AdamW step, pretrain_gpt iteration, Megatron-LM's pretrain() with megatron-core's
# optimizer and ours (losses, time, checkpoint resume), the trainer's CUDA-only paths (MoE router and
# dispatchers, RoPE) against its CPU ones; benchmarks/results/gpu_check.{json,md}.
# Without CUDA it builds everything and reports each check skipped with the reason (dry run).
gpu-check: $(STAMP)
	$(PY) benchmarks/gpu_check.py

venv: $(STAMP)

# gram-newton-schulz (the optional --muon-gram-newton-schulz-package backend) without its declared
# dependencies: they are CUDA-only (quack-kernels, nvidia-cutlass-dsl) and its torch path needs only torch.
# verl and AReaL (test dependencies: their FSDP engines hold our optimizer, docs/engines.md) the same way:
# they declare GPU stacks and pins we don't run (torch < 2.11, transformers <= 5.3); what they import is in
# pyproject's `engines` extra. tensordict 0.10.0 is verl's pin; its pyvers would pin packaging < 26.
# --compile-bytecode: where PYTHONDONTWRITEBYTECODE is set (CI's machines set it), Python never caches
# bytecode, and every process the suite starts compiled megatron-core and torch from source: `import
# megatron.core` took 17-19 s instead of 7 (2-core Zen 3). Compiling once costs 20 s at set-up.
NO_DEPS_PACKAGES := gram-newton-schulz==0.1.6 verl==0.9.1 areal==1.0.4 tensordict==0.10.0 pyvers==0.1.0
export NO_DEPS_PACKAGES
$(STAMP): pyproject.toml requirements.lock tools/find_python312.sh
	@py312=$$(tools/find_python312.sh) || exit 1; \
	echo "Creating $(VENV) with $$py312"; \
	rm -rf $(VENV) && "$$py312" -m venv $(VENV) && \
	$(PY) -m pip install --quiet --disable-pip-version-check uv && \
	$(VENV)/bin/uv pip install --quiet --compile-bytecode --python $(PY) -r requirements.lock && \
	$(VENV)/bin/uv pip install --quiet --python $(PY) --no-deps -e . && \
	$(VENV)/bin/uv pip install --quiet --compile-bytecode --python $(PY) --no-deps $(NO_DEPS_PACKAGES) && \
	touch $(STAMP)

# Re-resolve the pinned versions (needs the registry); commit the result.
lock:
	@py312=$$(tools/find_python312.sh) || exit 1; \
	uvx=$$(command -v uv || echo "$(VENV)/bin/uv"); \
	$$uvx pip compile pyproject.toml --extra dev --extra engines --extra scripts --python "$$py312" --python-version 3.12 -c tools/lock-constraints.txt -o requirements.lock

clean:
	rm -rf $(VENV) .pytest_cache
