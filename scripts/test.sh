#!/usr/bin/env bash
# Set up everything the test suite needs on a fresh machine, then run the whole suite.
# The README's second command and .ci/run both call exactly this script.
set -euo pipefail
cd "$(dirname "$0")/.."

# the end-to-end tests start real sshd instances on 127.0.0.x
if [ ! -x /usr/sbin/sshd ] || ! command -v ssh-keygen >/dev/null; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "scripts/test.sh: openssh-server is missing; install it (apt-get install openssh-server) or run as root" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq openssh-server openssh-client >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null && apt-get install -y -qq openssh-server openssh-client >/dev/null; }
fi

# the Slurm tests start their own munged, slurmctld and slurmd (tests/slurmcluster.py); they use
# none of the services the packages may start where systemd runs
if [ ! -x /usr/sbin/slurmctld ] || [ ! -x /usr/sbin/slurmd ] || [ ! -x /usr/sbin/munged ] || ! command -v sbatch >/dev/null; then
  if [ "$(id -u)" -eq 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null && apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null; }
  else
    echo "scripts/test.sh: Slurm is missing; the Slurm tests will be skipped (apt-get install slurmctld slurmd slurm-client munge as root)" >&2
  fi
fi

# the sites tests make network namespaces, veths and tc qdiscs (bench/sites.py, chaos link)
if ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
  if [ "$(id -u)" -eq 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq iproute2 >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null && apt-get install -y -qq iproute2 >/dev/null; }
  else
    echo "scripts/test.sh: iproute2 (ip, tc) is missing; the sites tests will fail (apt-get install iproute2)" >&2
  fi
fi

# the syncer's native merge kernel is compiled with the host's C compiler (its tests need one)
if ! command -v cc >/dev/null && ! command -v gcc >/dev/null; then
  if [ "$(id -u)" -eq 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq gcc libc6-dev >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null && apt-get install -y -qq gcc libc6-dev >/dev/null; }
  else
    echo "scripts/test.sh: no C compiler; the native-kernel tests will fail (apt-get install gcc)" >&2
  fi
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q -c constraints.txt -e '.[dev,train,plot]'

# the walls before any test: lint, formatting and types (ruff and mypy, configured in pyproject.toml)
.venv/bin/ruff check --quiet .
.venv/bin/ruff format --check --quiet .
.venv/bin/mypy

# pytest exits 5 when it collects no tests: with `set -e` that fails the run too
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "$@"
