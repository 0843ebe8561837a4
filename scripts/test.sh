#!/usr/bin/env bash
# Set up the venv if needed (default ./.venv; VENV=... for another, see setup.sh), then run the
# whole test suite (unit, 2-process gloo, slow ones too) with its Python, in TST_TEST_WORKERS
# pytest-xdist workers (default 2; 0: in this process), each given whole test files
# (--dist loadfile: a module's shared fixtures are built once).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# the Slurm tests (tests/slurm) start a one-node Slurm here; as root they apt-get what is missing
if [ "$(id -u)" = 0 ] && [ "${TST_NO_APT:-0}" != 1 ] && command -v apt-get >/dev/null \
    && ! { command -v slurmctld && command -v munged; } >/dev/null; then
    echo "test.sh: the Slurm tests will apt-get install slurm-wlm and munge system-wide (a one-node Slurm for tests/slurm); TST_NO_APT=1 skips those tests instead" >&2
fi
# two workers on 2 cores: one test's waits (process starts, imports, Slurm) overlap another's work
exec "${VENV:-.venv}/bin/python" -m pytest -n "${TST_TEST_WORKERS:-2}" --dist loadfile "$@"
