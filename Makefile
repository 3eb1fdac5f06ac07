# The two set-up commands of the README: `make demo` and `make test`. Both create .venv, install
# the CPU build of torch that lies on this kind of machine first, then agoractl and its extras,
# pinned by constraints.txt.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/agoractl: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	touch $@

.PHONY: install demo test
install: $(BIN)/agoractl

demo: install
	$(BIN)/agoractl demo

test: install
	$(BIN)/python -m pytest
