#!/usr/bin/env bash
# `make test`: pytest's tests as two sessions side by side, one a core. Most tests wait on worker
# processes, so one session keeps a 2-core machine about 60 % busy; two end in about 3/4 of the time.
# The split is fixed (no scheduler deals tests out), so each session runs its tests in the same order on
# every run. The first session prints as it goes; the second's output follows when both have ended.
# Usage: tools/pytest_in_two.sh PYTHON [pytest options...]
set -u
python=$1; shift
# Measured split (fresh clone, 2 cores): tests/functional and tests/unit/training with test_docs.py
# took 18:55 beside 12:15 for the rest; training's model tests and test_docs.py move to the second.
moved=tests/unit/training/model
first=(tests/functional tests/unit/training "--ignore=$moved")
second=(tests --ignore=tests/functional)  # pytest drops a path given under an ignored one: ignore its siblings
for path in tests/unit/training/*; do
  [ "$path" = "$moved" ] || [ "$(basename "$path")" = __pycache__ ] || second+=("--ignore=$path")
done
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
"$python" -m pytest "${first[@]}" -p no:cacheprovider --basetemp="$scratch/first" "$@" & first_pid=$!
"$python" -m pytest "${second[@]}" -p no:cacheprovider --basetemp="$scratch/second" "$@" \
  >"$scratch/second.log" 2>&1 & second_pid=$!
wait "$first_pid"; first_status=$?
wait "$second_pid"; second_status=$?
echo "==================== the second session: ${second[*]}"
cat "$scratch/second.log"
echo "make test: first session exit $first_status, second session exit $second_status"
[ "$first_status" -eq 0 ] && [ "$second_status" -eq 0 ]
