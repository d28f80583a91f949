#!/usr/bin/env bash
# GPU golden values: on a machine with one CUDA GPU, record golden_values_dev_<gpu>.json for every case of
# tests/functional/recipes/gpt_gpu.yaml, then run each case once more against them (the launcher's
# comparison, which prints each metric's largest difference: the measured spread the recipe's
# tolerances come from). Logs and both runs' TensorBoard events go to DIR (default runs/gpu_goldens).
#   tools/gpu_goldens.sh [DIR] [CASE ...]        STREAMS=N runs N cases at a time (default 1)
set -uo pipefail
cd "$(dirname "$0")/.."
dir=${1:-runs/gpu_goldens}; shift || true
recipe=tests/functional/recipes/gpt_gpu.yaml
python=${PYTHON:-python3}
cases=("$@")
if [ ${#cases[@]} -eq 0 ]; then
  mapfile -t cases < <("$python" -c "import sys, yaml; [print(n) for p in yaml.safe_load(open(sys.argv[1]))['products'] for n in p['test_case']]" "$recipe")
fi
mkdir -p "$dir"
one_case() {  # record, then replay against the record
  "$python" tools/run_functional_case.py "$1" --recipe "$recipe" --record --output "$dir/record/$1" >"$dir/$1.record.log" 2>&1 &&
    "$python" tools/run_functional_case.py "$1" --recipe "$recipe" --output "$dir/replay/$1" >"$dir/$1.replay.log" 2>&1
  echo "$1: exit $? ($(grep -c PASSED "$dir/$1.replay.log") passed, $(grep -c FAILED "$dir/$1.replay.log") failed)"
}
export -f one_case; export dir recipe python
printf '%s\n' "${cases[@]}" | xargs -P "${STREAMS:-1}" -I{} bash -c 'one_case {}'
