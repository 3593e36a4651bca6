#!/usr/bin/env bash
# Issue 34, part 2, on a GPU machine: one part per command (each under 10 minutes), from the repository root:
#     bash bench/gpu/run_all.sh 1      # correctness: device copies, resume equivalence, the demo
#     bash bench/gpu/run_all.sh 2      # the 1B figures
#     bash bench/gpu/run_all.sh 3      # the 100M figures (growth)
#     bash bench/gpu/run_all.sh all    # the most telling of 1 and 2 in one command (a 15-minute device budget)
# Extra arguments go to run_all.py (--dry-run: the CPU rehearsal). The wheels of `make gpu-wheels` (.whl/, carried
# with the tree) are installed beside the machine's own torch, never over it. PYTHON picks the interpreter.
set -u
if [ $# -lt 1 ]; then
    echo "usage: bash bench/gpu/run_all.sh 1|2|3|all [--dry-run] [--out DIR]" >&2
    exit 2
fi
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
if [[ " $* " != *" --dry-run "* ]] && compgen -G ".whl/*.whl" > /dev/null; then  # a dry run uses this machine's
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/hf_uc_site \
        .whl/*.whl || echo "run_all.sh: installing .whl/ failed; going on with what the machine has"
    export PYTHONPATH="/tmp/hf_uc_site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
exec "$PY" bench/gpu/run_all.py --part "$1" "${@:2}"
