#!/usr/bin/env bash
# Prints the path of a Python interpreter of at least the version asked for (default 3.12), or
# fails naming what it looked for. Looks at pythonX.Y on PATH, then at pyenv's installed versions.
# Usage: scripts/find_python.sh [MIN_MINOR] [MAX_MINOR]   (Python 3.MIN_MINOR .. 3.MAX_MINOR)
set -u
min=${1:-12}
max=${2:-13}
tried=()
ok() { "$1" -c "import sys; sys.exit(0 if (3,$min) <= sys.version_info[:2] <= (3,$max) else 1)" >/dev/null 2>&1; }
for minor in $(seq "$min" "$max"); do
  for cand in "python3.$minor" "python3"; do
    path=$(command -v "$cand" 2>/dev/null) || { tried+=("$cand (not on PATH)"); continue; }
    # pyenv shims answer for every version; resolve them to a real binary below instead.
    case "$path" in */shims/*) tried+=("$path (pyenv shim)"); continue ;; esac
    if ok "$path"; then echo "$path"; exit 0; fi
    tried+=("$path (wrong version)")
  done
done
root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
for minor in $(seq "$min" "$max"); do
  for dir in $(ls -d "$root"/versions/3."$minor"* 2>/dev/null | sort -rV); do
    for exe in "$dir/bin/python3.$minor" "$dir/bin/python3"; do
      if [ -x "$exe" ] && ok "$exe"; then echo "$exe"; exit 0; fi
      tried+=("$exe")
    done
  done
done
echo "find_python.sh: no Python 3.$min..3.$max found. Looked for: ${tried[*]:-nothing} and pyenv versions under $root/versions." >&2
echo "Install one (e.g. 'pyenv install 3.12') or put python3.12 on PATH." >&2
exit 1
