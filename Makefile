# Two environments, as in production: the Airflow side (.venv) never has pyspark, the Spark driver's
# Python (.venv-spark) never has Airflow.  apache-airflow-providers-apache-spark installs pyspark-client,
# which would overwrite the full pyspark wheel's files if both lived in one environment.
PYTHON ?= python3
VENV ?= .venv
SPARK_VENV ?= .venv-spark
PYTEST_ARGS ?=
DEMO_ARGS ?=
BENCH_ARGS ?=
PIP_FLAGS ?= --quiet --disable-pip-version-check

.PHONY: install browser test lint demo soak bench clean

# The provider is installed editable, so pip compiles none of it.  Where bytecode is not written
# (PYTHONDONTWRITEBYTECODE: the test deployments of Airflow set it, and so may the machine), every DAG
# parse, task and driver would compile its 300 kB of source again, where a wheel install compiles it once.
define compile_provider
	@echo ">> compiling the provider's Python"
	$(1)/bin/python -m compileall -q airflow_stream_provider
endef

# The two environments are built side by side: each waits on downloads and unpacking more than on a core.
# Every target that needs them depends on `install`, never on the files: a parallel make would build one
# environment twice at once.  For `make test` the same sub-make installs chromium beside them (about 25 s
# of apt on a fresh machine, mostly downloads and dpkg).
install:
	@$(MAKE) --no-print-directory -j3 $(VENV)/.installed $(SPARK_VENV)/.installed \
	  $(if $(filter test,$(MAKECMDGOALS)),browser)

# uv resolves and installs Airflow's ~160 packages, compiled, in a fraction of pip's minute (the same
# versions: pip freeze of both environments matches), in every CI run and every first demo.  Compiled,
# as pip does: where bytecode is not written (above), every Airflow process would compile its imports at
# each start.  uv reads neither pip.conf nor PIP_*: where it cannot install (a mirror only pip is told
# of), pip does.  The Spark side stays with pip: uv builds the pyspark sdist again on every install
# (25 s), where pip reuses the wheel it built once from its cache.
$(VENV)/.installed: pyproject.toml
	@echo ">> creating the Airflow-side environment in $(VENV)"
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_FLAGS) 'uv>=0.9,<1'
	$(VENV)/bin/uv pip install --quiet --compile-bytecode --python $(VENV)/bin/python \
	  -e '.[airflow,openlineage,test]' || $(VENV)/bin/pip install $(PIP_FLAGS) -e '.[airflow,openlineage,test]'
	$(call compile_provider,$(VENV))
	@touch $@

$(SPARK_VENV)/.installed: pyproject.toml
	@echo ">> creating the Spark-driver environment in $(SPARK_VENV)"
	$(PYTHON) -m venv $(SPARK_VENV)
	$(SPARK_VENV)/bin/pip install $(PIP_FLAGS) -e '.[spark,confluent]'
	@echo ">> pandas for the test jobs that need it, apart from the runtime's environment (a job's own dependency)"
	$(SPARK_VENV)/bin/pip install $(PIP_FLAGS) --target $(SPARK_VENV)/job-deps 'pandas<3'
	@echo ">> compiling the Python in Spark's zips (every Python process Spark starts imports pyspark from them)"
	$(SPARK_VENV)/bin/python -m airflow_stream_provider.runtime.precompile
	$(call compile_provider,$(SPARK_VENV))
	@touch $@

# The default test run: real Spark drivers, a real Kafka-protocol broker (Tansu), PostgreSQL and SQLite.
# The fixtures start the broker and a fresh PostgreSQL database themselves.  Two pytest workers: most
# of a driver scenario is waiting (start-up, triggers, polling), so two share the 2 cores well.  Three are
# no faster: 39:35 against 39:56 for the whole run on one machine (2026-12-01), as the drivers' starts
# then wait for the cores instead.  Variants marked `soak` (a scenario's second database, the demo, see
# README "Tests") wait for `make soak`: the run stays within 35 minutes on 2 cores.
test: install
	$(VENV)/bin/python -m pytest -m "not soak" -n 2 --dist worksteal --durations=15 $(PYTEST_ARGS)

# The status page's browser test drives Debian's chromium (Playwright's own download cannot work here).
browser:
	@command -v chromium >/dev/null 2>&1 || { echo ">> installing Debian's chromium for the browser test"; \
	  $$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get update -qq && \
	  $$( [ "$$(id -u)" = 0 ] || echo sudo ) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

lint: install
	$(VENV)/bin/ruff check .

# The main job's whole life on the embedded default: local Spark, SQLite, Tansu, Airflow's own SQLite.
demo: install
	$(VENV)/bin/python -m demo $(DEMO_ARGS)

# Recovery time, throughput and scaling against the baseline; writes benchmarks/results/ (about 25 min on
# 2 cores; BENCH_ARGS="--profile quick" checks the whole path in a few minutes).  What each cut of the cold
# start saves runs only when named (about 4 minutes): BENCH_ARGS="--only cold_cuts --update".  Recovery
# under a real Airflow, against the former polling DAG and SparkSubmitOperator, runs only when named (about
# an hour): BENCH_ARGS="--only cold mttr_real_airflow --update"; so does the warm standby's takeover over ten
# kills (about 15 minutes): BENCH_ARGS="--only cold standby --update".
bench: install
	@$(MAKE) --no-print-directory $(VENV)/.bench-installed
	$(VENV)/bin/python -m benchmarks $(BENCH_ARGS)

$(VENV)/.bench-installed: pyproject.toml $(VENV)/.installed
	$(VENV)/bin/pip install $(PIP_FLAGS) -e '.[airflow,openlineage,test,bench]'
	@touch $@

# The default run's `soak` variants, then the soak itself (tests/e2e/test_soak.py), then ten standby kills.
soak: install
	$(VENV)/bin/python -m pytest -m soak $(PYTEST_ARGS)
	STREAM_STANDBY_KILLS=10 $(VENV)/bin/python -m pytest tests/e2e/test_standby.py -k kill9 $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(SPARK_VENV) .pytest_cache .ruff_cache .demo .bench
