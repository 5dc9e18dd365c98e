#!/usr/bin/env bash
# Accelerator mode, in one go: GPT-2-small (124M), context 1024, bf16 compute, synthetic
# batches; attention 'xla' vs 'cudnn', statistics on/off, the plain-JAX reference; tokens/s,
# MFU against the bf16 matmul peak measured in the same process, compiled memory.
#
# Needs only what the device image has (jax, flax, optax, numpy): no ml-collections, grain,
# tensorflow-datasets, torch or transformers, and no wheels to carry. On the device machine
# (the device tool, from the repository root):
#   bash benchmarks/accel.sh                 # writes $OUT/accel.json (else benchmarks/results/)
# Extra arguments go to `python -m benchmarks.run`, e.g. `--steps 10`; on a CPU,
# `--accel_force` runs the miniature shape (tests/test_benchmarks.py does, with the other
# packages made unimportable).
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
"$py" -c 'import jax; print("jax", jax.__version__, jax.devices())'
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$py" -m benchmarks.run --suite accel \
  --steps "${STEPS:-20}" --out "$out/accel.json" "$@"
