# make run / make test / make fuzz / make bench: each bootstraps .venv when missing;
# make test also fetches ocloc (make ocloc).
PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.lighthouse-installed

.PHONY: run test fuzz bench train venv clean ocloc

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --quiet -e '.[test,xegpu,bench]'
	touch $(STAMP)

run: $(STAMP)
	$(VPY) -m lighthouse.compile examples/attention.py --run --check

# Intel's offline GPU compiler for the xegpu target's native stage (Debian's packages,
# unpacked into .cache/ocloc; a few seconds, then a no-op); the tests build every XeGPU
# kernel with it. LIGHTHOUSE_OCLOC or an ocloc on PATH takes precedence at run time.
ocloc:
	tools/fetch-ocloc

# two workers (the machine's cores: compiles are single-threaded), a test file per worker
test: $(STAMP) ocloc
	$(VPY) -m pytest -q -n 2 --dist loadfile

# differential fuzzing against torch: 500 cases per family (FUZZ_EXAMPLES=N to change), shrunk
# failures in tests/fuzz/failures/ (see tests/fuzz/profiles.py for the knobs)
fuzz: $(STAMP)
	FUZZ_PROFILE=fuzz $(VPY) -m pytest -q tests/fuzz --hypothesis-show-statistics

# a small GPT trained eagerly, with torch.compile(backend="lighthouse") and with inductor
train: $(STAMP)
	$(VPY) examples/train_gpt.py

bench: $(STAMP)
	$(VPY) -m lighthouse.bench --csv bench.csv --json bench.json --plot bench.png

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .cache
