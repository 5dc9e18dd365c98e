"""One entry point for every benchmark suite: JSON out, a markdown table to
stdout.

  python -m benchmarks.run --suite all --out benchmarks/results/cpu.json python
  -m benchmarks.run --suite train,overhead --mini          # seconds, smoke test
  python -m benchmarks.run --suite accel --out $OUT/accel.json    # on a GPU
  machine

Suites (`SUITES`): train, overhead, side_by_side, eval, scaling, accel, data.
The side_by_side suite times every implementation round-robin in one process and
is a diagnostic only; the published comparison is `python -m
benchmarks.per_process` (each implementation and each framework's matmul peak in
its own process). Derived ratios that need two suites (eval and input pipeline
over train tokens/s) are added under `summary` when both ran in the same
process."""

from __future__ import annotations

import argparse
from collections.abc import Callable
import json
import os
import sys
import time
from typing import Any

from benchmarks import common
from benchmarks import report
from benchmarks import suites
from benchmarks.suites import Options


def _data_suite(opts: Options) -> dict[str, Any]:
  from benchmarks import data_suite  # owned by the data stage

  return data_suite.run_suite(opts)


def _accel(opts: Options) -> dict[str, Any]:
  from benchmarks import accel

  return accel.run_accel(opts, force=getattr(opts, 'accel_force', False))


def _scaling(opts: Options) -> dict[str, Any]:
  from benchmarks import scaling

  return scaling.run_scaling(opts)


# Registry: name -> function(Options) -> JSON-serializable dict.
SUITES: dict[str, Callable[[Options], dict[str, Any]]] = {
    'train': suites.run_train,
    'overhead': suites.run_overhead,
    'side_by_side': suites.run_side_by_side,
    'eval': suites.run_eval,
    'scaling': _scaling,
    'accel': _accel,
    'data': _data_suite,
}
ALL = ('train', 'overhead', 'side_by_side', 'eval', 'data', 'scaling', 'accel')


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument(
      '--suite',
      default='all',
      help=f"comma-separated: {', '.join(SUITES)} or all",
  )
  p.add_argument(
      '--out', default='', help='JSON file to write (default: print only)'
  )
  p.add_argument(
      '--mini',
      action='store_true',
      help='miniature shapes, few steps (smoke test)',
  )
  p.add_argument(
      '--steps',
      type=int,
      default=None,
      help='timed steps per measurement (default 20)',
  )
  p.add_argument(
      '--warmup', type=int, default=None, help='untimed steps first (default 3)'
  )
  p.add_argument(
      '--blocks',
      type=int,
      default=None,
      help='overhead: alternating blocks (>= 5)',
  )
  p.add_argument(
      '--block_steps', type=int, default=None, help='overhead: steps per block'
  )
  p.add_argument(
      '--peers', default=Options.peers, help='side_by_side peers to try'
  )
  p.add_argument(
      '--torch_threads', type=int, default=0, help='torch threads (0 = default)'
  )
  p.add_argument(
      '--accel_force', action='store_true', help='run accel on CPU (miniature)'
  )
  return p.parse_args(argv)


def make_options(a: argparse.Namespace) -> Options:
  """Options from parsed flags; --mini shrinks the defaults, explicit flags
  win."""
  d = dict(steps=3, warmup=1, blocks=2, block_steps=2) if a.mini else {}
  opts = Options(mini=a.mini, peers=a.peers, torch_threads=a.torch_threads, **d)
  for k in ('steps', 'warmup', 'blocks', 'block_steps'):
    if getattr(a, k) is not None:
      setattr(opts, k, getattr(a, k))
  for k, lo in (('steps', 1), ('warmup', 0), ('blocks', 1), ('block_steps', 1)):
    if getattr(opts, k) < lo:
      raise SystemExit(f'--{k} must be >= {lo}, got {getattr(opts, k)}.')
  opts.accel_force = a.accel_force  # type: ignore[attr-defined]
  return opts


def select(spec: str) -> list[str]:
  names = (
      list(ALL)
      if spec == 'all'
      else [s.strip() for s in spec.split(',') if s.strip()]
  )
  bad = [n for n in names if n not in SUITES]
  if bad or not names:
    raise SystemExit(
        f"Unknown suite(s) {bad or spec!r}; valid: {', '.join(SUITES)} or all."
    )
  return names


def main(argv: list[str] | None = None) -> dict[str, Any]:
  a = parse_args(argv)
  names = select(a.suite)
  opts = make_options(a)
  result: dict[str, Any] = {
      'machine': common.machine_info(),
      'started': suites.timestamp(),
      'options': dict(vars(a).items()),
      'suites': {},
  }
  for name in names:
    t0 = time.perf_counter()
    print(f'[benchmarks] {name} ...', file=sys.stderr, flush=True)
    try:
      out = SUITES[name](opts)
    except ImportError as e:
      out = {'skipped': f'suite unavailable: {e}'}
    out['wall_s'] = time.perf_counter() - t0
    result['suites'][name] = out
  result['summary'] = report.summary(result)
  text = json.dumps(result, indent=1, default=str)
  if a.out:
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, 'w') as f:
      f.write(text)
  print(report.markdown(result))
  return result


if __name__ == '__main__':
  main()
