"""Accelerator mode: GPT-2-small (124M) in bfloat16 on synthetic batches, MFU vs measured peak.

Runs where `jax.default_backend()` is 'gpu' or 'tpu'; on a CPU it returns a `skipped`
note unless `--accel_force` (then it runs the miniature shape, for the smoke test).
Batches are synthetic (random tokens, one document per row), so no dataset is needed.
The peak is the best bf16 FLOP/s of a large square matmul in the same process (an H200
measured about 790 TFLOP/s this way). Parameters are float32, compute bfloat16, logits
and loss float32 (`model.dtype='bfloat16'`).

On a device machine that has jax/flax/optax but not ml-collections/grain/tfds, use
`benchmarks/accel.sh` (it installs ml-collections from wheels carried in `.whl/`, see its
header, then runs `python -m benchmarks.run --suite accel`).
"""

from __future__ import annotations

import dataclasses
import traceback
from typing import Any

import jax

from benchmarks import common
from benchmarks import steps
from benchmarks.suites import Options, measure


def run_accel(opts: Options, force: bool = False) -> dict[str, Any]:
  """GPT-2-small bf16 train step (stats on/off, plain reference), MFU against the bf16 peak."""
  backend = jax.default_backend()
  if backend == 'cpu' and not force:
    return {'skipped': 'no accelerator (backend cpu); run on a GPU/TPU machine, or pass '
                       '--accel_force for a miniature CPU run'}
  shape = common.GPT2_SMALL if backend != 'cpu' else common.MINI.replace(dtype='bfloat16')
  sizes = (4096, 8192) if backend != 'cpu' else (256,)
  peak = common.matmul_peak('bfloat16', sizes, repeats=10 if backend != 'cpu' else 3)
  sub = dataclasses.replace(opts, steps=max(opts.steps, 20 if backend != 'cpu' else 3))
  rows, failed = [], {}
  builders = {
      'stats_on': lambda: steps.library_train(shape, True),
      'stats_off': lambda: steps.library_train(shape, False),
      'stats_on_position_guard': lambda: steps.library_train(
          shape, True, **{'model.check_positions': True}),
      'reference': lambda: steps.reference_train(shape, kernel_layout='out_in'),
  }
  if backend == 'gpu':
    builders['stats_on_cudnn'] = lambda: steps.library_train(
        shape, True, **{'model.attention_impl': 'cudnn'})
  for name, build in builders.items():
    try:
      row = measure(build(), shape, sub, peak['flops_per_s'])
      row['variant'] = name
      rows.append(row)
    except Exception as e:  # pylint: disable=broad-except
      failed[name] = f'{type(e).__name__}: {e}'.splitlines()[0][:300]
      traceback.print_exc()
  return {'backend': backend, 'devices': [str(d) for d in jax.devices()],
          'shape': dataclasses.asdict(shape), 'peak': peak, 'rows': rows, 'failed': failed}
