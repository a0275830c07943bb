# Every stage is a Hydra app; pass overrides with ARGS="key=value ...".
PY := .venv/bin/python
ARGS ?=
INIT ?= aqmedai_k2
# the suite runs in this many pytest-xdist workers (CI has 2 cores; each test runs torch on one thread)
TEST_WORKERS ?= 2

.PHONY: setup test faults mini-world prepare capture-hidden vocab train train-online eval export demo study learning-ab bench-vocab clean check bench-serve

setup: .venv/.installed
.venv/.installed: pyproject.toml ; python3 -m venv .venv && .venv/bin/pip install -q --upgrade pip && .venv/bin/pip install -q -e '.[dev]' && touch $@
test: setup ; $(PY) -m pytest tests -n $(TEST_WORKERS) $(ARGS)
faults: setup ; $(PY) -m pytest tests/faults $(ARGS)
mini-world: setup ; $(PY) data/run_mini_world.py $(ARGS)
prepare: setup ; $(PY) data/run_prepare.py $(ARGS)
capture-hidden: setup ; $(PY) data/run_capture.py $(ARGS)
vocab: setup ; $(PY) data/run_vocab.py $(ARGS)
train: setup ; $(PY) train/run.py +init=$(INIT) $(ARGS)
# online: this run starts the streaming producer itself (train/local_producer.py; docs/online_training.md)
train-online: setup ; $(PY) train/run.py +init=$(INIT) data.source=stream data.producer=local $(ARGS)
eval: setup ; $(PY) eval/run.py $(ARGS)
export: setup ; $(PY) export/run.py $(ARGS)
check: setup ; $(PY) export/run_check.py $(ARGS)
demo: setup ; $(PY) pipeline/run_demo.py $(ARGS)
study: setup ; $(PY) pipeline/run_study.py $(ARGS)
bench-serve: setup ; $(PY) eval/run_bench_serve.py $(ARGS)
learning-ab: setup ; $(PY) pipeline/run_learning_ab.py $(ARGS)
clean: ; rm -rf runs
