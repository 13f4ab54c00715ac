# Sourced by the scripts: make sure .venv exists and holds what this checkout needs.
#
# torch is pinned to 2.13.0 on purpose: that CPU build is what CI machines serve
# locally; an unpinned torch would pull a multi-GB CUDA build. vLLM is installed
# without its dependencies: the tests only need its sleep-mode ABC, factory and
# plugin loader, which import on CPU with packaging and regex.
# Set HIBERNATE_VENV to use another location.

HIBERNATE_TORCH="torch==2.13.0"
HIBERNATE_VLLM="vllm==0.33.0"

ensure_venv() {
  local root venv stamp want
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
  venv="${HIBERNATE_VENV:-$root/.venv}"
  stamp="$venv/.hibernate-deps"
  want="$(cat "$root/pyproject.toml" "$root/scripts/lib/venv.sh" | sha256sum | cut -c1-16)"
  if [ ! -x "$venv/bin/python" ]; then
    echo "creating virtual environment in $venv" >&2
    python3 -m venv "$venv"
  fi
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "installing hibernate and its test dependencies into $venv" >&2
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$HIBERNATE_TORCH"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e "$root[dev]"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "$HIBERNATE_VLLM"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check packaging regex
    echo "$want" > "$stamp"
  fi
  VENV="$venv"
  export PATH="$venv/bin:$PATH"
}
