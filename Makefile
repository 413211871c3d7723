# microvm.sandbox: two set-up commands on a fresh Debian machine: `make demo`, `make test`.
SHELL := /bin/bash
.DEFAULT_GOAL := help
PYTHON ?= python3
VENV := .venv
PY := $(CURDIR)/$(VENV)/bin/python
BIN := $(CURDIR)/$(VENV)/bin
COLLECTIONS := $(CURDIR)/.local/collections
COLL_LINK := $(COLLECTIONS)/ansible_collections/microvm/sandbox
export ANSIBLE_COLLECTIONS_PATH := $(COLLECTIONS)
export PYTHONPATH := $(COLLECTIONS):$(CURDIR)/localplane
export PATH := $(BIN):$(PATH)
# Caches shared by every clone on this machine, keyed by content (README: "Caches"): the venvs
# (hack/cached_venv.py), the base template's rootfs, mypy's cache.
ifeq ($(origin MICROVM_SANDBOX_CACHE),undefined)
MICROVM_SANDBOX_CACHE := $(shell $(PYTHON) hack/cached_venv.py --cache-root)
endif
export MICROVM_SANDBOX_CACHE
# One cache of the base template's Debian rootfs for every plane make starts (built once, minutes).
export MICROVM_LOCALPLANE_CACHE ?= $(MICROVM_SANDBOX_CACHE)/localplane
# Debian packages: runc and uidmap (guests of the local control plane: an OCI
# runtime, each guest in its own user namespace over subordinate ids),
# umoci and skopeo (unpacking OCI templates), buildah (template_image role),
# docker-registry (a real local OCI registry), debootstrap (the built-in
# `base` template's own Debian rootfs, and the role's base image with no
# registry pull), openssh-server (the SSH peer in bench/), rsync, sudo,
# podman (builds and runs the execution environment, make ee-test; with runc,
# since crun refuses cgroup v1 hosts).
# bindep.txt lists the same packages by profile (hack/bindep-check.py).
DEB_PACKAGES := runc uidmap umoci skopeo buildah docker-registry debootstrap openssh-server rsync sudo podman
# Subordinate ids of the user running the local control plane: each guest gets its own
# 65536 of them (localplane/microvm_localplane/idmap.py). Added when the user has none.
SUBID_START := 1000000000
SUBID_COUNT := 1073741824
PYTEST_ARGS ?=
# pytest-xdist workers for the guest-bound suites (hack/pytest-count.sh); 1 runs them in one process.
export PYTEST_WORKERS ?= 3
NEWEST_SUITES ?= tests/integration/test_collection_build.py tests/integration/test_ssh_habits.py tests/integration/test_connection.py::test_battery_pipelining_on_and_off tests/integration/test_modules_sessions.py tests/unit/plugins/plugin_utils/test_option_defs.py tests/unit/plugins/plugin_utils/test_warm.py $(CORE_SUITES)
# What every supported ansible-core must pass: its internals the connection relies on (_shared/core_compat.py),
# every task served by the warm runner, and big transfers on the bulk line (on that core's Python), through the real stack.
API_SUITES := $(addprefix tests/integration/,test_connection.py test_connection_shared.py test_connection_fastpath.py \
	test_ssh_habits.py test_hostile_output.py test_sync.py test_hostile_sync.py)
CORE_SUITES := tests/unit/plugins/plugin_utils/test_core_compat.py tests/integration/test_connection_fastpath.py::test_every_task_is_served_warm \
	tests/integration/test_connection_fastpath.py::test_a_later_run_takes_its_payloads_from_the_cache \
	tests/unit/plugins/plugin_utils/test_bulk_line.py tests/integration/test_bulk_transfer.py::test_a_playbooks_copy_and_fetch_take_the_bulk_line

.PHONY: help venv system-deps collection base-rootfs proto proto-check lint typecheck sanity ansible-lint docs-lint docs \
        unit localplane-test integration integration-api molecule galaxy-import ee-test test check test-newest test-newest-sanity test-newest-suites test-core220 test-live demo local-up local-down sweep build clean clean-images bench bench-fleet docsite

help:
	@echo "make demo   - set up everything and run the demo end to end on the local control plane"
	@echo "make test   - set up and run the whole suite (lint, sanity, unit, integration, e2e), about 17 minutes"
	@echo "make check  - the fast tier for every merge: lint, types, unit tests, the plane's unit tests (minutes)"
	@echo "make integration-api - the connection, become and sync suites over transport api, agent port closed"
	@echo "make docs   - build the HTML docsite into docs/build/html"
	@echo "make local-up / local-down - start / stop the local control plane (.local/env)"
	@echo "make sweep  - stop the guests and remove the mounts that killed local planes left on this host"
	@echo "make proto  - regenerate the guest agent stubs from protos/"
	@echo "make docsite - regenerate the docsite's extra docs (docs/docsite/rst) from docs/*.md and the README"
	@echo "make bench  - run the benchmarks in bench/"
	@echo "make bench-fleet - one controller against 100 and 500 sessions (FLEET_COUNTS), vs SSH to as many hosts (long)"
	@echo "make typecheck - mypy over plugins/ and the share of annotated functions (hack/typed_share.py)"
	@echo "make clean  - remove .local (planes, caches, results) and this project's images (make clean-images)"
	@echo "make ee-test - build an execution environment (ansible-builder, podman) and run a playbook in it"
	@echo "make galaxy-import - run Galaxy's importer (offline) on the built tarball"
	@echo "make molecule - run every Molecule scenario (extensions/molecule/) on a local control plane of its own"

# Each venv is a thin overlay of this clone over a shared venv cached by content (hack/cached_venv.py): built
# once per machine and requirement set, then made here in well under a second. Run every time: it checks its key.
$(VENV)/.stamp: FORCE
	@$(PYTHON) hack/cached_venv.py --dest $(VENV) -r requirements-dev.txt --localplane localplane
	@touch $@

FORCE:

venv: $(VENV)/.stamp

# The newest ansible-core runs on Python 3.12+; pyenv provides 3.13 on this kind of machine.
PYTHON_NEWEST ?= $(shell for p in $$HOME/.pyenv/versions/3.13*/bin/python3.13 python3.13 $$HOME/.pyenv/versions/3.12*/bin/python3.12 python3.12; do \
  "$$p" -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null && { echo "$$p"; break; }; done)
.venv-newest/.stamp: FORCE
	@[ -n "$(PYTHON_NEWEST)" ] || { echo "Python 3.12 or 3.13 not found: install one (pyenv install 3.13) or set PYTHON_NEWEST"; exit 1; }
	@$(PYTHON_NEWEST) hack/cached_venv.py --dest .venv-newest -r requirements-newest.txt
	@touch $@

# ansible-core 2.20 (Python 3.12+), for make test-core220: the supported core between .venv's and .venv-newest's.
PYTHON_CORE220 ?= $(shell for p in $$HOME/.pyenv/versions/3.12*/bin/python3.12 python3.12 $$HOME/.pyenv/versions/3.13*/bin/python3.13 python3.13; do \
  "$$p" -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null && { echo "$$p"; break; }; done)
.venv-220/.stamp: FORCE
	@[ -n "$(PYTHON_CORE220)" ] || { echo "Python 3.12 or 3.13 not found: install one (pyenv install 3.12) or set PYTHON_CORE220"; exit 1; }
	@$(PYTHON_CORE220) hack/cached_venv.py --dest .venv-220 -r requirements-core220.txt
	@touch $@

system-deps:
	@missing=""; for p in $(DEB_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then echo "installing Debian packages:$$missing"; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing >/dev/null || \
	    { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing >/dev/null; }; \
	  else echo "Missing Debian packages:$$missing"; \
	    echo "  runc/uidmap: isolated guests of the local control plane; umoci/skopeo: OCI templates;"; \
	    echo "  debootstrap: the base template's rootfs and the template_image role; buildah/docker-registry:"; \
	    echo "  template_image role; openssh-server: bench only."; \
	    echo "  Install them as root: apt-get install -y$$missing"; exit 1; fi; fi
	@user=$$(id -un); for f in /etc/subuid /etc/subgid; do \
	  grep -q "^$$user:" $$f 2>/dev/null && continue; \
	  if [ "$$(id -u)" = 0 ]; then echo "adding subordinate ids $$user:$(SUBID_START):$(SUBID_COUNT) to $$f"; \
	    echo "$$user:$(SUBID_START):$(SUBID_COUNT)" >> $$f; \
	  else echo "$$f has no entry for $$user: as root, add $$user:$(SUBID_START):$(SUBID_COUNT)"; exit 1; fi; done

# The collection must resolve as ansible_collections/microvm/sandbox.
collection:
	@mkdir -p $(dir $(COLL_LINK))
	@[ -L $(COLL_LINK) ] || ln -sfn $(CURDIR) $(COLL_LINK)

setup: venv system-deps collection base-rootfs

# The built-in `base` template's own Debian rootfs (debootstrap, once: about 2 minutes; then instant).
base-rootfs: venv system-deps
	$(PY) -m microvm_localplane.baseimage --state-dir $(CURDIR)/.local/plane

proto: venv
	$(PY) hack/gen_proto.py

proto-check: venv
	$(PY) hack/gen_proto.py --check

# The guides (docs/*.md, the README's quick start) as the docsite's extra docs (docs/docsite/rst/).
docsite: venv
	$(PY) hack/gen_docsite.py

lint: venv
	$(BIN)/ruff check .

# mypy over plugins/ (config: pyproject.toml [tool.mypy]) and the share of annotated functions (hack/typed_share.py).
typecheck: venv collection
	bash hack/typecheck.sh

sanity: setup
	bash hack/sanity.sh

ansible-lint: setup
	cd $(CURDIR) && $(BIN)/ansible-lint --profile production --offline

docs-lint: setup
	$(BIN)/antsibull-docs lint-collection-docs --plugin-docs --skip-rstcheck .

docs: setup
	bash hack/docs.sh

unit: setup
	bash hack/pytest-count.sh unit tests/unit

localplane-test: setup
	bash hack/pytest-count.sh localplane localplane/tests

integration: setup
	bash hack/pytest-count.sh integration tests/integration

# The connection, become and sync suites again over `transport: api` (the documented exec and file API), with the
# agent port closed to the port-forward: tests that need the agent road are skipped there, naming why.
integration-api: setup
	MICROVM_TEST_TRANSPORT=api bash hack/pytest-count.sh integration-api $(API_SUITES)

molecule: setup
	bash hack/molecule.sh

# Every check and suite (hack/test.sh: two lanes, guest-bound suites on pytest-xdist workers); about 15 minutes.
test: setup $(if $(filter 1,$(SKIP_NEWEST)),,.venv-newest/.stamp .venv-220/.stamp)
	bash hack/test.sh

# The fast tier, for every merge: lint, types, the unit tests and the plane's unit tests (no guest), in minutes.
check: venv collection
	bash hack/check.sh

# Sanity and the end-to-end smoke suites with the newest ansible-core on Python 3.13.
test-newest: test-newest-sanity test-newest-suites

test-newest-sanity: setup .venv-newest/.stamp
	VENV_BIN=$(CURDIR)/.venv-newest/bin bash hack/sanity.sh

test-newest-suites: setup .venv-newest/.stamp
	PATH=$(CURDIR)/.venv-newest/bin:$$PATH PYTEST_PYTHON=$(CURDIR)/.venv-newest/bin/python \
	  bash hack/pytest-count.sh newest-core $(NEWEST_SUITES)

# ansible-core 2.20: its internals the connection relies on, and the warm path through the real stack.
test-core220: setup .venv-220/.stamp
	PATH=$(CURDIR)/.venv-220/bin:$$PATH PYTEST_PYTHON=$(CURDIR)/.venv-220/bin/python \
	  bash hack/pytest-count.sh core-220 $(CORE_SUITES)

test-live: setup
	@if [ -z "$$DO_AGENTS_API_URL" ] || [ -z "$$DO_AGENTS_API_TOKEN" ]; then \
	  echo "test-live skipped: set DO_AGENTS_API_URL and DO_AGENTS_API_TOKEN to run the contract tests against the real platform"; \
	else MICROVM_LIVE=1 bash hack/pytest-count.sh live localplane/tests/contract; fi

local-up: setup
	$(PY) -m microvm_localplane up --state-dir $(CURDIR)/.local/plane --env-file $(CURDIR)/.local/env

local-down: venv
	$(PY) -m microvm_localplane down --state-dir $(CURDIR)/.local/plane

sweep: venv
	$(PY) -m microvm_localplane sweep

demo: setup
	bash hack/demo.sh

ee-test: setup
	bash hack/ee-test.sh

galaxy-import: setup
	bash hack/galaxy-import.sh

build: setup
	$(BIN)/ansible-galaxy collection build --force --output-path .local/dist .

bench: setup .venv-newest/.stamp
	PYTHON_NEWEST=$(PYTHON_NEWEST) bash bench/run.sh

# Issue 46: 10 tasks on each of FLEET_COUNTS sessions from one controller (forks 50), against SSH with a
# ControlMaster per host, each count on a plane of its own (bench/fleet_bench.py; results in bench/results/fleet-*.json).
# Not in `make bench`: the SSH side alone takes tens of minutes at 500 on a 2-core machine.
FLEET_COUNTS ?= 100,500
FLEET_ARGS ?=
bench-fleet: setup
	PYTHONPATH=$(PYTHONPATH):$(CURDIR)/tests/support $(PY) bench/fleet_bench.py --counts $(FLEET_COUNTS) $(FLEET_ARGS)

# Images this checkout put into the containers store (buildah's and podman's): the
# demo's template and base images and the execution environment's, found by the
# label every build of this checkout carries (hack/checkout-label.sh), with their
# build containers and superseded builds. Other checkouts' images are left alone.
clean-images:
	@bash hack/clean-images.sh

clean: clean-images
	rm -rf .local tests/output docs/build

# The machine's shared cache (venvs, the base rootfs, mypy's): every clone's next `make` rebuilds what it needs.
.PHONY: clean-cache
clean-cache:
	rm -rf "$(MICROVM_SANDBOX_CACHE)"
