#!/usr/bin/env bash
# Print the path of a Python 3.12 interpreter, or explain how to get one and exit 1.
# Order: $PYTHON312, then the newest 3.12.x that `pyenv versions` lists, then python3.12 on PATH.
set -u
is_312() { "$1" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 12) else 1)' 2>/dev/null; }

if [ -n "${PYTHON312:-}" ]; then
  if is_312 "$PYTHON312"; then echo "$PYTHON312"; exit 0; fi
  echo "PYTHON312=$PYTHON312 is not a Python 3.12 interpreter." >&2; exit 1
fi
if command -v pyenv >/dev/null 2>&1; then
  newest=$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12\.[0-9]+$' | sort -t. -k3 -n | tail -n 1)
  if [ -n "$newest" ]; then
    candidate=$(PYENV_VERSION="$newest" pyenv which python3.12 2>/dev/null)
    if [ -n "$candidate" ] && is_312 "$candidate"; then echo "$candidate"; exit 0; fi
  fi
fi
candidate=$(command -v python3.12 2>/dev/null)
if [ -n "$candidate" ] && is_312 "$candidate"; then echo "$candidate"; exit 0; fi

cat >&2 <<'MSG'
No Python 3.12 interpreter found (megatron-core and emerging-optimizers need Python 3.12).
Tried: $PYTHON312, the newest 3.12.x listed by `pyenv versions`, and python3.12 on PATH.
Install one (for example `pyenv install 3.12`) or point PYTHON312 at it: make test PYTHON312=/path/to/python3.12
MSG
exit 1
