# Sourced by the scripts: make sure .venv exists and holds what this checkout needs.
#
# torch is pinned to 2.13.0 on purpose: that CPU build is what CI machines serve
# locally; an unpinned torch would pull a multi-GB CUDA build. vLLM is installed
# without its dependencies: the tests only need its sleep-mode ABC, factory and
# plugin loader, which import on CPU with packaging and regex.
# Set HIBERNATE_VENV to use another location.

HIBERNATE_TORCH="torch==2.13.0"
HIBERNATE_VLLM="vllm==0.33.0"

# One pip install into venv $1, its output appended to log $2; on failure the log is shown.
pip_step() {
  local venv="$1" log="$2"
  shift 2
  if ! "$venv/bin/python" -m pip install --disable-pip-version-check "$@" >> "$log" 2>&1; then
    cat "$log" >&2
    echo "pip install $* failed; its output is above and in $log" >&2
    return 1
  fi
}

# Says which install step begins ($1: its number, $2: what it installs), and how long the one before took:
# the whole install is silent otherwise (pip's output goes to the log) and lasts minutes.
step_began=""
announce_step() {
  local done_in=""
  [ -n "$step_began" ] && done_in=" (previous step: $((SECONDS - step_began)) s)"
  echo "  [$1/5] $2$done_in" >&2
  step_began=$SECONDS
}

ensure_venv() {
  local root venv stamp want
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
  venv="${HIBERNATE_VENV:-$root/.venv}"
  stamp="$venv/.hibernate-deps"
  # The compiled helper is built by the editable install: a change to it installs again.
  want="$(cat "$root/pyproject.toml" "$root/setup.py" "$root/hibernate/store/_bulk.c" "$root/scripts/lib/venv.sh" | sha256sum | cut -c1-16)"
  if [ ! -x "$venv/bin/python" ]; then
    echo "creating virtual environment in $venv (first run)" >&2
    python3 -m venv "$venv"
  fi
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    # pip's own output (including its complaint that the --no-deps vLLM lacks its
    # dependencies, which is intended) goes to a log shown only when a step fails.
    local log="$venv/install.log" began=$SECONDS
    echo "installing what this checkout needs into $venv, in 5 steps (first run, or its requirements" \
      "changed): about 2 to 4 minutes with a CPU build of torch, much longer if pip fetches torch's" \
      "CUDA build (several GB: see README.md, Install); pip's output goes to $log" >&2
    : > "$log"
    step_began=""
    announce_step 1 "pip itself"
    pip_step "$venv" "$log" --upgrade pip || return 1
    announce_step 2 "$HIBERNATE_TORCH (the longest step: a CPU build is about 200 MB)"
    pip_step "$venv" "$log" "$HIBERNATE_TORCH" || return 1
    announce_step 3 "hibernate with its test tools (building its small C extension)"
    pip_step "$venv" "$log" -e "${root}[dev]" || return 1
    announce_step 4 "$HIBERNATE_VLLM without its dependencies (the tests need only its sleep-mode ABC and plugin loader)"
    pip_step "$venv" "$log" --no-deps "$HIBERNATE_VLLM" || return 1
    announce_step 5 "packaging and regex (what vLLM's plugin loader imports)"
    pip_step "$venv" "$log" packaging regex || return 1
    echo "$want" > "$stamp"
    echo "installed in $((SECONDS - began)) s" >&2
  fi
  VENV="$venv"
  export PATH="$venv/bin:$PATH"
}
