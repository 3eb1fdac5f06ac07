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

# Debian packages the tests and `launch swarm`'s monitoring use (promtool, Prometheus, its push gateway), and
# the Chromium that the Dashboard's browser test drives through Playwright (Playwright cannot download its own
# browser here), installed when missing (apt-get as root, else through sudo).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
.PHONY: install demo test system-packages
install: $(BIN)/agoractl

system-packages:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null && command -v prometheus-pushgateway >/dev/null \
	  && [ -x /usr/bin/chromium ] \
	  || { $(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q prometheus \
	       prometheus-pushgateway chromium; }

demo: install system-packages
	$(BIN)/agoractl demo

test: install system-packages
	$(BIN)/python -m pytest
