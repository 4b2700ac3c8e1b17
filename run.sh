#!/usr/bin/env bash
# mgpu_lab's one entry point. Each command sets itself up on a fresh machine:
# it creates .venv (once), installs torch ($TORCH_SPEC) and this package into it,
# then runs.
#
#   ./run.sh lab     JupyterLab on labs/ (the main job)
#   ./run.sh tour    the headless tour: runs every solution notebook, prints a table
#   ./run.sh test    the whole test suite (unit tests, nbval over solutions/, grader)
#   ./run.sh gpu     on a GPU machine: the GPU benchmarks and tests, every lab in a kernel
#                    that used CUDA first -> gpu-results.json (--no-install: no venv)
#   ./run.sh mgpu-lab ARGS...   any mgpu-lab command inside the environment
#
# TORCH_SPEC picks the torch to install. By default: the CUDA build ("torch") where
# nvidia-smi is found or off Linux; on a Linux machine without a GPU, the CPU build
# from PyTorch's CPU index (about 200 MB instead of several GB of CUDA libraries)
# when that index answers within 5 s, else "torch". CI pins a CPU wheel that is on
# its machine: TORCH_SPEC="torch==2.13.0".
set -euo pipefail
cd "$(dirname "$0")"

VENV="${VENV:-.venv}"
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
# matplotlib's font cache lives in the environment: a cache another environment wrote
# (under ~/.cache, naming fonts that are gone) makes every plot warn on stderr.
export MPLCONFIGDIR="${MPLCONFIGDIR:-$VENV/matplotlib}"
CPU_INDEX="https://download.pytorch.org/whl/cpu"
if [ -z "${TORCH_SPEC:-}" ]; then
  TORCH_SPEC="torch"
  if ! command -v nvidia-smi >/dev/null 2>&1 && [ "$(uname -s)" = Linux ] &&
     python3 -c "import urllib.request as u; u.urlopen('$CPU_INDEX/torch/', timeout=5)" 2>/dev/null; then
    TORCH_SPEC="torch --index-url $CPU_INDEX"
  fi
fi
PY="$VENV/bin/python"

# setup EXTRAS: the package with those extras (course: JupyterLab and the lab
# tools; test: pytest too).
setup() {
  local extras="$1"
  if [ ! -x "$PY" ]; then
    echo "run.sh: creating $VENV" >&2
    python3 -m venv "$VENV"
  fi
  # Re-install only when the torch spec or pyproject.toml changed.
  local want stamp="$VENV/.mgpu-lab-installed"
  want="$TORCH_SPEC|$extras|$(cksum < pyproject.toml)"
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "run.sh: installing $TORCH_SPEC and mgpu_lab[$extras] into $VENV (once)" >&2
    # shellcheck disable=SC2086  # TORCH_SPEC may carry pip options
    case "$TORCH_SPEC" in
      *" -"*)   # options (an index) for torch alone: torch first, then the rest from PyPI
        "$PY" -m pip install --quiet --no-compile $TORCH_SPEC
        "$PY" -m pip install --quiet --no-compile -e ".[$extras]" ;;
      *)        # one resolution, not two: 64-73 s of set-up here against 75 s
        "$PY" -m pip install --quiet --no-compile $TORCH_SPEC -e ".[$extras]" ;;
    esac
    # Byte-compile what pip installed on every core (pip compiles one file at a time).
    "$PY" -m compileall -q -j 0 "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
      >/dev/null 2>&1 || true
    echo "$want" > "$stamp"
  fi
  # Build the font cache now, not in the first notebook cell that plots (its message would
  # be cell output).
  "$PY" -c "import matplotlib.font_manager" >/dev/null 2>&1 || true
  # Byte-compile the package now: graded kernels import it in a read-only sandbox, where
  # Python caches nothing it compiles (nor anywhere under PYTHONDONTWRITEBYTECODE=1).
  "$PY" -m compileall -q mgpu_lab >/dev/null 2>&1 || true
}

# apt_install COMMAND PACKAGE: a Debian package that optional tests need, when we can
# (root and apt-get). Never fails the run.
apt_install() {
  command -v "$1" >/dev/null 2>&1 && return 0
  { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; } || return 0
  echo "run.sh: installing $2 (apt-get)" >&2
  (apt-get install -y -qq "$2" >/dev/null 2>&1 ||
    { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq "$2" >/dev/null 2>&1; }) || true
}

cmd="${1:-}"
[ $# -gt 0 ] && shift
case "$cmd" in
  lab)
    setup course,lightning
    # Jupyter refuses to run as root (containers, cloud VMs) unless told it is fine.
    [ "$(id -u)" = 0 ] && set -- --allow-root "$@"
    exec "$VENV/bin/jupyter" lab labs/ "$@"
    ;;
  tour)
    setup course,lightning
    exec "$VENV/bin/mgpu-lab" tour "$@"
    ;;
  test)
    setup course,test,lightning,data
    # The grader's sandbox (bubblewrap) and the browser test's Chromium: installed when
    # we can; the tests that need them skip, saying why, where they are missing.
    apt_install bwrap bubblewrap
    apt_install chromium chromium
    # OMP threads: 2 processes per test on a 2-core machine; one thread each.
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
    # Two workers (pytest-xdist), a file each at a time (a notebook's cells run in order in
    # one kernel), in collection order: tests/test_mutants.py, which waits for the mutation
    # run grading beside them, comes last (xdist's default order, most tests first, gave it
    # to a worker that then waited five minutes while the other did the rest alone).
    exec "$PY" -m pytest -p mgpu_lab.course -n 2 --dist loadfile --no-loadscope-reorder tests solutions \
      --nbval --nbval-current-env --nbval-cell-timeout=300 \
      --nbval-sanitize-with solutions/sanitize.cfg "$@"
    ;;
  gpu)
    # --no-install: a GPU machine without a package index, whose python3 already has torch
    # (the notebook stack on PYTHONPATH): run this checkout with that python.
    if [ "${1:-}" = --no-install ]; then
      shift
      PY=python3
      export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    else
      setup course,test,lightning,data
    fi
    command -v nvidia-smi >/dev/null 2>&1 ||
      { echo "run.sh gpu: no nvidia-smi here; run it on a machine with an NVIDIA GPU" >&2; exit 2; }
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
    exec "$PY" -m mgpu_lab.course.authoring.gpu_pass --out "${GPU_RESULTS:-gpu-results.json}" "$@"
    ;;
  mgpu-lab)
    setup course,lightning
    exec "$VENV/bin/mgpu-lab" "$@"
    ;;
  *)
    sed -n '2,/^set -euo/{/^#/p}' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
