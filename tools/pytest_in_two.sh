#!/usr/bin/env bash
# `make test`: pytest's tests as two sessions side by side, one a core. Most tests wait on worker
# processes, so one session keeps a 2-core machine about 60 % busy; two end in about 3/4 of the time.
# The split is fixed (no scheduler deals tests out), so each session runs its tests in the same order on
# every run. The first session prints as it goes; the second's output follows when both have ended.
# Usage: tools/pytest_in_two.sh PYTHON [pytest options...]
set -u
python=$1; shift
first=(tests/functional tests/unit/training tests/unit/test_docs.py)
ignored=(); for path in "${first[@]}"; do ignored+=("--ignore=$path"); done
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
"$python" -m pytest "${first[@]}" -p no:cacheprovider --basetemp="$scratch/first" "$@" & first_pid=$!
"$python" -m pytest tests "${ignored[@]}" -p no:cacheprovider --basetemp="$scratch/second" "$@" \
  >"$scratch/second.log" 2>&1 & second_pid=$!
wait "$first_pid"; first_status=$?
wait "$second_pid"; second_status=$?
echo "==================== the second session: tests/ but ${first[*]}"
cat "$scratch/second.log"
echo "make test: first session exit $first_status, second session exit $second_status"
[ "$first_status" -eq 0 ] && [ "$second_status" -eq 0 ]
