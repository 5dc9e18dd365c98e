#!/usr/bin/env bash
# Accelerator mode (GPT-2-small bf16, synthetic batches) on a GPU machine, in one go.
#
# Prepare here (network to the package index), once:
#   pip download --no-deps -d .whl ml_collections absl-py PyYAML
# then on the device machine (the device tool, with carry [".whl"]):
#   bash benchmarks/accel.sh            # writes $OUT/accel.json (or benchmarks/results/)
# The device image has jax/flax/optax/orbax but not ml-collections (imported by the
# config code); the carried wheels fill that gap. grain/tfds are not needed for this suite.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python -c 'import ml_collections' 2>/dev/null; then
  pip install -q --no-index --find-links .whl ml_collections absl-py PyYAML
fi
python -c 'import jax; print(jax.devices())'
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
python -m benchmarks.run --suite accel --steps "${STEPS:-20}" --out "$out/accel.json"
