#!/usr/bin/env bash
# Install as users do: build the wheel from a clean copy of the working tree, install it into a fresh virtual
# environment outside the checkout (torch's CPU build first, then the wheel under constraints.txt), and from
# another directory run the CLI, a tiny random pair, `ddtree generate` and examples/python_api.py on it.
# `make test-wheel` runs this; PYTHON picks the interpreter (default python3), KEEP=1 keeps the directory.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
work="$(mktemp -d "${TMPDIR:-/tmp}/ddtree-wheel.XXXXXX")"
if [ "${KEEP:-0}" = 1 ]; then
  trap 'echo "test-wheel: kept $work"' EXIT
else
  trap 'rm -rf "$work"' EXIT
fi
step() { echo "test-wheel: $*"; }

# A wheel built in the checkout could carry modules that build/ kept from an earlier build: build from a copy
# of the files git tracks or would track (untracked ones not ignored), as they are in the working tree.
step "copying the source to $work/src"
mkdir -p "$work/src"
if git -C "$root" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  git -C "$root" ls-files -z --cached --others --exclude-standard |
    while IFS= read -r -d '' path; do if [ -e "$root/$path" ]; then printf '%s\0' "$path"; fi; done |
    tar -C "$root" --null -T - -cf - | tar -C "$work/src" -xf -
else
  tar -C "$root" --exclude=./.venv --exclude=./build --exclude=./dist --exclude='*.egg-info' -cf - . |
    tar -C "$work/src" -xf -
fi

step "building the wheel"
"$python" -m pip wheel --quiet --no-deps -w "$work/dist" "$work/src"
wheel="$(ls "$work"/dist/ddtree-*.whl)"
step "built $(basename "$wheel")"

step "creating a fresh virtual environment in $work/venv"
"$python" -m venv "$work/venv"
bin="$work/venv/bin"
"$bin/pip" install --quiet --upgrade pip
step "installing torch==2.13.0 (the CPU build; an unpinned torch would pull a multi-GB CUDA build)"
"$bin/pip" install --quiet torch==2.13.0
step "installing the wheel with -c constraints.txt"
"$bin/pip" install --quiet -c "$root/constraints.txt" "$wheel"

cd "$work"  # nothing below may see the checkout
step "ddtree --help"
"$bin/ddtree" --help >/dev/null
step "import ddtree: from the environment, without torch until a name is used; the shipped drafter present"
"$bin/python" - "$work/venv" <<'EOF'
import sys

import ddtree

assert ddtree.__file__.startswith(sys.argv[1]), f"ddtree imported from {ddtree.__file__}, not the environment"
ddtree.__all__
assert "torch" not in sys.modules, "import ddtree imported torch"
from ddtree.models.default import default_drafter

assert (default_drafter() / "model.safetensors").is_file(), "the wheel ships no default drafter weights"
EOF

step "making a tiny random pair"
"$bin/ddtree" models init-tiny --out "$work/tiny/target"
"$bin/ddtree" drafter init --model "$work/tiny/target" --out "$work/tiny/drafter" --block-size 8

step "ddtree generate on it"
"$bin/ddtree" generate --model "$work/tiny/target" --drafter "$work/tiny/drafter" --method ddtree --budget 8 \
  --max-new-tokens 16 --prompt "Hello, tree" --json >"$work/generate.json"
"$bin/python" -c '
import json, sys
record = json.loads(open(sys.argv[1]).read())
assert len(record["token_ids"]) == 16 and record["steps"] >= 1, record
' "$work/generate.json"

step "examples/python_api.py on it"
cp "$root/examples/python_api.py" "$work/"
"$bin/python" python_api.py --model "$work/tiny/target" --drafter "$work/tiny/drafter" --max-new-tokens 16 \
  >"$work/python_api.out"
grep -Eq '^tau [0-9]+\.[0-9]{2} over [0-9]+ steps' "$work/python_api.out" || {
  cat "$work/python_api.out"
  echo "test-wheel: examples/python_api.py printed no tau line" >&2
  exit 1
}

step "passed: the wheel installs and runs outside the checkout"
