"""Accelerator mode: GPT-2-small (124M) in bfloat16 on synthetic batches, MFU vs
measured peak.

Runs where `jax.default_backend()` is 'gpu' or 'tpu'; on a CPU it returns a
`skipped` note unless `--accel_force` (then it runs the miniature shape, for the
smoke test). Batches are synthetic (random tokens, one document per row), so no
dataset is needed. The peak is the best bf16 FLOP/s of a large square matmul in
the same process (an H200 measured about 790 TFLOP/s this way). Parameters are
float32, compute bfloat16, logits and loss float32 (`model.dtype='bfloat16'`).

Rows: the library's step with statistics on and off, each with `attention_impl`
'xla' and (on a GPU) 'cudnn', and the plain-JAX reference; each row has
tokens/s, MFU and the compiled memory (`memory_analysis()` of the step:
arguments, temporaries, peak).

Nothing here needs ml-collections, grain or tensorflow-datasets (configs come
from `benchmarks.common.base_config`), so it runs on the device image as it is:
`bash benchmarks/accel.sh` (tests/test_benchmarks.py runs that script on a CPU
with those packages made unimportable)."""

from __future__ import annotations

import dataclasses
import functools
import traceback
from typing import Any

import jax

from benchmarks import common
from benchmarks import steps
from benchmarks.suites import Options
from benchmarks.suites import measure


def run_accel(opts: Options, force: bool = False) -> dict[str, Any]:
  """GPT-2-small bf16 train step (stats on/off, plain reference), MFU against
  the bf16 peak."""
  backend = jax.default_backend()
  if backend == 'cpu' and not force:
    return {
        'skipped': (
            'no accelerator (backend cpu); run on a GPU/TPU machine, or pass '
            '--accel_force for a miniature CPU run'
        )
    }
  shape = (
      common.GPT2_SMALL
      if backend != 'cpu'
      else common.MINI.replace(dtype='bfloat16')
  )
  sizes = (4096, 8192) if backend != 'cpu' else (256,)
  peak = common.matmul_peak(
      'bfloat16', sizes, repeats=10 if backend != 'cpu' else 3
  )
  sub = dataclasses.replace(
      opts, steps=max(opts.steps, 20 if backend != 'cpu' else 3)
  )
  rows = []
  failed = {}
  builders = {}
  for impl in ('xla', 'cudnn'):
    for stats in (True, False):
      name = f"stats_{'on' if stats else 'off'}_{impl}"
      if impl == 'cudnn' and backend != 'gpu':
        failed[name] = (
            f'skipped: cudnn attention needs a GPU (backend {backend})'
        )
        continue
      builders[name] = functools.partial(
          steps.library_train, shape, stats, **{'model.attention_impl': impl}
      )
  builders['reference'] = functools.partial(
      steps.reference_train, shape, kernel_layout='out_in'
  )
  for name, build in builders.items():
    try:
      runner = build()
      row = measure(runner, shape, sub, peak['flops_per_s'])
      row['variant'] = name
      try:
        row['memory'] = common.compiled_memory(runner.lower().compile())
      except Exception as e:
        row['memory'] = None
        row['memory_error'] = f'{type(e).__name__}: {e}'.splitlines()[0][:200]
      rows.append(row)
    except Exception as e:
      failed[name] = f'{type(e).__name__}: {e}'.splitlines()[0][:300]
      traceback.print_exc()
  return {
      'backend': backend,
      'devices': [str(d) for d in jax.devices()],
      'shape': dataclasses.asdict(shape),
      'peak': peak,
      'rows': rows,
      'failed': failed,
  }


def export_train_step(
    shape: common.Shape,
    platforms: tuple[str, ...] = ('cuda',),
    collect_stats: bool = True,
    **overrides,
):
  """`jax.export` of the library's train step at `shape` for `platforms`,
  without a device.

  The state is abstract (`jax.eval_shape` of `train_step.init_state`), so
  GPT-2-small costs no memory; lowering for 'cuda' on a CPU-only jaxlib catches
  GPU-only lowering errors (unsupported dtypes or custom calls) before a device
  run.

  Returns:
    The `jax.export.Exported`.
  """
  from flax_posemb import auto
  from flax_posemb import sharding
  from flax_posemb import train_step as training

  config = common.model_config(shape, collect_stats=collect_stats, **overrides)
  config, _ = auto.resolve_config(
      config, platform='gpu' if 'cuda' in platforms else platforms[0]
  )
  mesh = sharding.make_mesh()
  model = training.make_model(config)
  box = {}

  def init(key):
    state, box['tx'], box['shardings'] = training.init_state(
        model, config, mesh, key
    )
    return state

  state = jax.eval_shape(init, jax.random.key(0))
  step = training.make_train_step(
      model, box['tx'], config, mesh, box['shardings']
  )
  batch = {
      k: jax.ShapeDtypeStruct(v.shape, v.dtype)
      for k, v in common.synthetic_batch(shape.replace(batch_size=1)).items()
  }
  batch = {
      k: jax.ShapeDtypeStruct((shape.batch_size,) + v.shape[1:], v.dtype)
      for k, v in batch.items()
  }
  rng = jax.eval_shape(lambda: jax.random.key(1))
  return jax.export.export(step, platforms=list(platforms))(state, batch, rng)
