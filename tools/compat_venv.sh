#!/usr/bin/env bash
# Build .venv-torch-VERSION: requirements.lock with another torch (make test-compat).
# torch's own CUDA libraries (nvidia-*, cuda-*) and triton follow that torch version; every other
# pin stays the lock's, so the run differs from `make test`'s only in torch.
set -euo pipefail
version=$1
venv=.venv-torch-$version
[ -f "$venv/.installed" ] && exit 0
py312=$(tools/find_python312.sh)
pins=$(mktemp)
trap 'rm -f "$pins"' EXIT
grep -v -E '^(torch|triton|nvidia-[a-z0-9-]+|cuda-[a-z-]+)==' requirements.lock > "$pins"
echo "torch==$version" >> "$pins"
echo "Creating $venv with $py312 (torch $version)"
rm -rf "$venv" && "$py312" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check uv
"$venv/bin/uv" pip install --quiet --compile-bytecode --python "$venv/bin/python" -r "$pins"  # see Makefile
"$venv/bin/uv" pip install --quiet --python "$venv/bin/python" --no-deps -e .
# The Makefile's NO_DEPS_PACKAGES (gram-newton-schulz, verl, AReaL, ...), as `make venv` installs them.
"$venv/bin/uv" pip install --quiet --compile-bytecode --python "$venv/bin/python" --no-deps ${NO_DEPS_PACKAGES:?run through make test-compat}
touch "$venv/.installed"
