#!/usr/bin/env bash
# Create .venv with Python 3.12 and install the project with its test, data, slurm and hf extras.
# megatron-core 0.19.2 ships cp312 wheels only, so 3.12 is required.
set -euo pipefail
cd "$(dirname "$0")/.."
find_py312() {
  if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
  if command -v python3.12 >/dev/null 2>&1 && python3.12 -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    command -v python3.12; return
  fi
  if command -v pyenv >/dev/null 2>&1; then
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.|$)'); do
      echo "$(pyenv root)/versions/$v/bin/python3.12"; return
    done
  fi
}
py=$(find_py312)
if [ -z "$py" ] || ! "$py" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
  echo "error: Python 3.12 not found (megatron-core 0.19.2 has cp312 wheels only)." >&2
  echo "fix: install it, e.g. 'pyenv install 3.12' or 'apt-get install python3.12 python3.12-venv'," >&2
  echo "     or point PYTHON=/path/to/python3.12 at one." >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test,data,slurm,hf]'
echo "installed into .venv ($(.venv/bin/python --version))"
