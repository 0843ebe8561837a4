#!/usr/bin/env bash
# Mutation testing of the method's core and the run plan with mutmut (configured in
# pyproject.toml, [tool.mutmut]: tst_megatron/superposition/*, loop/plan.py and
# loop/switch.py against the fast unit tests that cover them). Prints the score per file
# and every surviving mutant (`mutmut show <name>` shows one). Not part of CI: about 17 minutes
# on 2 cores (docs/testing.md, "Mutation testing"). MUTMUT_CHILDREN: parallel mutants (2).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
rm -rf mutants
.venv/bin/mutmut run --max-children "${MUTMUT_CHILDREN:-2}" >/dev/null 2>&1 || true
.venv/bin/mutmut results --all true | .venv/bin/python scripts/mutation_report.py
