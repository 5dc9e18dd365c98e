"""Speed suites: train step, statistics overhead, side by side, eval.

Each `run_*` takes an `Options` and returns a JSON-serializable dict. Ratios are
computed inside one process so that they compare numbers measured on the same
machine in the same run (single steps on a shared CPU vary 10-15%; ratios of
medians are far steadier)."""

from __future__ import annotations

import dataclasses
import time
import traceback
from typing import Any

import numpy as np

from benchmarks import common
from benchmarks import steps


@dataclasses.dataclass
class Options:
  """What every suite reads from the command line."""

  mini: bool = False  # Miniature shapes and few steps (smoke test).
  # Timed steps per measurement (>= 20 for the published table).
  steps: int = 20
  warmup: int = 3  # Untimed steps first (compilation included).
  blocks: int = 6  # Alternating on/off blocks for the overhead suite.
  block_steps: int = 10  # Steps per block.
  # Side-by-side peers to try.
  peers: str = 'reference,hf_flax,torch_eager,torch_compile'
  torch_threads: int = 0  # torch.set_num_threads (0 = torch's default).
  # Matmul peak measured once per run (filled by run.py).
  peak: dict | None = None

  @property
  def shapes(self) -> list[common.Shape]:
    return [common.MINI] if self.mini else [common.SMALL, common.TINY]

  @property
  def main_shape(self) -> common.Shape:
    return common.MINI if self.mini else common.SMALL


def get_peak(opts: Options, dtype: str = 'float32') -> dict[str, Any]:
  """Matmul peak, measured once per run and cached in `opts.peak`."""
  if opts.peak is None or opts.peak.get('dtype') != dtype:
    sizes = (256,) if opts.mini else (1024, 2048)
    opts.peak = common.matmul_peak(dtype, sizes, repeats=3 if opts.mini else 5)
  return opts.peak


_MEASURED: dict[Any, dict[str, Any]] = {}


def measure(
    runner: steps.Runner, shape: common.Shape, opts: Options, peak: float
) -> dict[str, Any]:
  """Times a runner and derives tokens/s (from the median step) and MFU.

  A runner measured once with the same step counts is not re-timed by a later
  suite of the same run: train, side_by_side and eval then quote one and the
  same measurement."""
  key = (id(runner), shape, opts.steps, opts.warmup)
  if key not in _MEASURED:
    _MEASURED[key] = _measure(runner, shape, opts, peak)
  return dict(_MEASURED[key])


def interleaved(
    runners: list[steps.Runner], opts: Options, per_round: int = 2
) -> list[list[float]]:
  """Times runners round-robin (`per_round` steps each per round) until each has
  `opts.steps`.

  Interleaving spreads every implementation over the same stretch of time, so
  load changes on a shared machine hit all of them alike instead of whichever
  ran last."""
  for r in runners:
    common.time_calls(r.call, 0, opts.warmup)
  out: list[list[float]] = [[] for _ in runners]
  while len(out[0]) < opts.steps:
    for r, ts in zip(runners, out):
      ts += common.time_calls(r.call, min(per_round, opts.steps - len(ts)), 0)
  return out


def _measure(
    runner: steps.Runner, shape: common.Shape, opts: Options, peak: float
) -> dict[str, Any]:
  t = common.summarize(common.time_calls(runner.call, opts.steps, opts.warmup))
  return _row(runner, shape, t, peak)


def _row(
    runner: steps.Runner, shape: common.Shape, t: dict[str, Any], peak: float
) -> dict[str, Any]:
  fpt = common.flops_per_token(shape, runner.n_params_no_pos)
  tps = shape.tokens / t['median_s']
  out = {
      'name': runner.name,
      **t,
      'tokens_per_s': tps,
      'tokens_per_s_min': shape.tokens / t['max_s'],
      'tokens_per_s_max': shape.tokens / t['min_s'],
      'flops_per_token': fpt,
      'mfu': tps * fpt / peak,
      'params_no_pos': runner.n_params_no_pos,
  }
  if runner.note:
    out['note'] = runner.note
  return out


def run_train(opts: Options) -> dict[str, Any]:
  """Train-step tokens/s and MFU, statistics on (the default) and off, per
  shape."""
  peak = get_peak(opts)['flops_per_s']
  res = {'peak': opts.peak, 'shapes': {}}
  for shape in opts.shapes:
    rows = [
        measure(steps.library_train(shape, cs), shape, opts, peak)
        for cs in (True, False)
    ]
    res['shapes'][shape.name] = {
        'shape': dataclasses.asdict(shape),
        'rows': rows,
    }
  return res


def run_overhead(opts: Options) -> dict[str, Any]:
  """Statistics on vs off: alternating blocks, per-block median ratio, bootstrap
  CI.

  Blocks alternate the order (on-off, off-on, ...) so slow drifts of a shared
  machine cancel. The overhead is `median_on / median_off - 1` per block pair;
  the reported figure is the median over pairs with a 95% percentile-bootstrap
  interval."""
  shape = opts.main_shape
  on = steps.library_train(shape, True)
  off = steps.library_train(shape, False)
  for r in (on, off):
    common.time_calls(r.call, 0, opts.warmup)
  ratios = []
  med_on = []
  med_off = []
  for i in range(opts.blocks):
    order = (on, off) if i % 2 == 0 else (off, on)
    meds = {}
    for r in order:
      meds[r.name] = float(
          np.median(common.time_calls(r.call, opts.block_steps, 1))
      )
    med_on.append(meds[on.name])
    med_off.append(meds[off.name])
    ratios.append(meds[on.name] / meds[off.name] - 1.0)
  lo, hi = common.bootstrap_ci(np.asarray(ratios))
  return {
      'shape': dataclasses.asdict(shape),
      'blocks': opts.blocks,
      'block_steps': opts.block_steps,
      'overhead_per_block': ratios,
      'median_on_s': med_on,
      'median_off_s': med_off,
      'overhead_median': float(np.median(ratios)),
      'overhead_ci95': [lo, hi],
      'target': 'CI upper bound <= 0.03',
      'meets_target': bool(hi <= 0.03),
  }


def _peer_builders(shape: common.Shape, opts: Options) -> dict[str, Any]:
  th = opts.torch_threads or None
  return {
      'reference': lambda: steps.reference_train(shape),
      'reference_out_in': lambda: steps.reference_train(
          shape, kernel_layout='out_in'
      ),
      'reference_causal': lambda: steps.reference_train(
          shape, kernel_layout='out_in', segment_mask=False
      ),
      'hf_flax': lambda: steps.hf_flax_train(shape),
      'torch_eager': lambda: steps.torch_train(shape, False, threads=th),
      'torch_compile': lambda: steps.torch_train(shape, True, threads=th),
  }


DIAGNOSTIC_NOTE = (
    'diagnostic: all implementations round-robin in one process (thread pools '
    'compete); the fair table is python -m benchmarks.per_process'
)


def run_side_by_side(opts: Options) -> dict[str, Any]:
  """DIAGNOSTIC: the library's step next to peers round-robin inside ONE
  process.

  Not the published comparison: two runtimes in one process (XLA's pool and
  PyTorch's OpenMP threads, which spin after each region) compete for the same
  cores, which skews the ratios (0.54x here against ~0.74x per process on the
  same class of machine). The fair table is `python -m benchmarks.per_process`
  (each implementation in its own process). This mode stays for quick in-process
  checks.

  Peers that are not installed (the `bench` extra) or fail are listed under
  `skipped` with the reason, never an error."""
  shape = opts.main_shape
  peak = get_peak(opts)['flops_per_s']
  runners = [
      (steps.library_train(shape, cs), 'library', None) for cs in (True, False)
  ]
  builders = _peer_builders(shape, opts)
  wanted = [p for p in opts.peers.split(',') if p]
  if 'reference' in wanted and not opts.mini:
    wanted += ['reference_out_in', 'reference_causal']
  skipped = {}
  for name in dict.fromkeys(wanted):
    if name not in builders:
      skipped[name] = f'unknown peer; valid: {sorted(builders)}'
      continue
    try:
      runners.append((builders[name](), 'peer', name))
    except ImportError as e:
      skipped[name] = f'not installed ({e}); pip install -e ".[bench]"'
    except Exception as e:
      skipped[name] = f'failed: {type(e).__name__}: {e}'.splitlines()[0][:300]
      traceback.print_exc()
  times = interleaved([r for r, _, _ in runners], opts)
  rows = []
  for (runner, kind, peer), ts in zip(runners, times):
    row = _row(runner, shape, common.summarize(ts), peak)
    row['kind'] = kind
    if peer:
      row['peer'] = peer
    rows.append(row)
  peers = [r for r in rows if r['kind'] == 'peer']
  best = max(peers, key=lambda r: r['tokens_per_s']) if peers else None
  for r in rows:
    r['ratio_to_fastest_peer'] = (
        r['tokens_per_s'] / best['tokens_per_s'] if best else None
    )
  return {
      'shape': dataclasses.asdict(shape),
      'peak': opts.peak,
      'rows': rows,
      'fastest_peer': best['name'] if best else None,
      'skipped': skipped,
      'target': 'library (stats on) >= 1.1 x fastest peer',
      'note': DIAGNOSTIC_NOTE,
  }


def run_eval(opts: Options) -> dict[str, Any]:
  """Eval-step tokens/s as a ratio to train tokens/s (stats on), same shape,
  same run."""
  shape = opts.main_shape
  peak = get_peak(opts)['flops_per_s']
  train = measure(steps.library_train(shape, True), shape, opts, peak)
  ev = measure(steps.library_eval(shape), shape, opts, peak)
  ev.pop('mfu')  # the 6N formula is for training; eval is ~2N per token
  ratio = ev['tokens_per_s'] / train['tokens_per_s']
  return {
      'shape': dataclasses.asdict(shape),
      'train': train,
      'eval': ev,
      'eval_over_train': ratio,
      'target': '>= 3',
      'meets_target': bool(ratio >= 3),
  }


def timestamp() -> str:
  return time.strftime('%Y-%m-%dT%H:%M:%S%z')
