"""Fair side by side: every implementation (and each framework's matmul peak) in
its own process.

  python -m benchmarks.per_process        # the README table ->
  benchmarks/results/cpu_per_process.json python -m benchmarks.per_process
  --rounds 2 --steps 5 --impls stats_on,torch_compile   # quicker python -m
  benchmarks.per_process --impls
  stats_off,stats_off:model.attention_impl=blocked --rounds 6

Why processes: two runtimes in one process (XLA's thread pool and PyTorch's
OpenMP pool, which spins after each parallel region) compete for the same cores,
and a JAX step timed right after a PyTorch step pays for PyTorch's spinning
threads. `benchmarks.run --suite side_by_side` (all implementations round-robin
in one process) is kept as a diagnostic only.

Protocol: `--rounds` rounds; in each round every implementation runs once, in a
fresh Python process, in an order rotated by one per round (so no implementation
always follows the same neighbour); a process builds its step, runs `--warmup`
untimed steps (compilation included), then times `--steps` steps and reports
their median wall time and median process CPU time (user + system, all threads;
steadier than wall time when other jobs share the machine, though a runtime
whose idle threads spin is charged for the spinning). Every process gets the
same shape, the same CPU affinity (`--cpus`, default: all) and the same thread
count (`--threads`, default: the cores in that affinity; PyTorch's
`set_num_threads` and OpenMP, XLA's intra-op pool follows the affinity). The
table shows, per implementation, the median over rounds of the per-round medians
and the min-max over rounds; ratios to the reference implementation
(`--ratio_to`, default torch.compile) are taken per round (same stretch of
machine time) and their median and min-max reported. The matmul peak (`2n^3`
FLOP of a jitted / torch square fp32 matmul, best of n in 1024, 2048) is
measured in its own process per framework and per round; each implementation's
MFU uses its own framework's peak.

Implementation specs: a name from `IMPLS`, optionally followed by
`:key=value;key=value`. Keys `model.*`, `optimizer.*` and top-level config keys
override the library's config (values parsed as Python literals when possible);
`env.NAME=value` sets an environment variable in that process only (e.g.
`env.XLA_FLAGS=--xla_cpu_use_thunk_runtime=true`)."""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Any

IMPLS = {
    # name: (framework, human label)
    'stats_on': ('jax', 'flax_posemb (statistics on)'),
    'stats_off': ('jax', 'flax_posemb (statistics off)'),
    'reference': ('jax', 'plain JAX reference (benchmarks/reference_model.py)'),
    'hf_flax': ('jax', 'Hugging Face FlaxGPT2LMHeadModel'),
    'torch_eager': ('torch', 'PyTorch eager (HF GPT2LMHeadModel)'),
    'torch_compile': ('torch', 'PyTorch torch.compile (HF GPT2LMHeadModel)'),
    'peak_jax': ('jax', 'fp32 matmul peak, JAX'),
    'peak_torch': ('torch', 'fp32 matmul peak, PyTorch'),
}
# The library as configured by default (no overrides: what a plain train.py
# runs, attention and microbatches chosen by flax_posemb.auto; on CPU blocked
# attention and ~1k-token microbatches, 4 of 4 rows at the small shape), also
# with glibc's malloc on transparent huge pages (an environment setting: fewer
# TLB misses on the activation buffers); the step before these defaults (XLA
# attention, one batch) and blocked attention alone; the peers, PyTorch also
# with the same 4 microbatches and with the same huge pages (like for like).
CPU_BEFORE = "model.attention_impl='xla';grad_accum_steps=1"
BLOCKED_ONLY = "model.attention_impl='blocked';grad_accum_steps=1"
HUGE_PAGES = 'env.GLIBC_TUNABLES=glibc.malloc.hugetlb=1'
DEFAULT_IMPLS = (
    f'stats_on,stats_off,stats_on:{HUGE_PAGES},stats_off:{HUGE_PAGES},'
    f'stats_on:{CPU_BEFORE},stats_on:{BLOCKED_ONLY},'
    'reference,hf_flax,torch_eager,'
    f'torch_compile,torch_compile:grad_accum_steps=4,torch_compile:{HUGE_PAGES}'
)
SHAPES = ('small', 'tiny', 'mini')


def split_specs(text: str) -> list[str]:
  """Splits `--impls` at the commas that start a new implementation name (values
  such as `env.XLA_FLAGS=--flag=a,b` may contain commas)."""
  names = '|'.join(map(re.escape, IMPLS))
  return [s for s in re.split(rf',(?=(?:{names})(?::|,|$))', text) if s]


def parse_spec(spec: str) -> tuple[str, dict[str, Any], dict[str, str]]:
  """`name:k=v;k=v` -> (name, config overrides, env). Raises ValueError on a bad
  spec."""
  name, _, rest = spec.partition(':')
  if name not in IMPLS:
    raise ValueError(
        f'unknown implementation {name!r}; valid: {", ".join(IMPLS)}'
    )
  overrides = {}
  env = {}
  for item in filter(None, rest.split(';')):
    k, eq, v = item.partition('=')
    if not eq:
      raise ValueError(f'bad override {item!r} in {spec!r} (want key=value)')
    if k.startswith('env.'):
      env[k[4:]] = v
    else:
      try:
        overrides[k] = ast.literal_eval(v)
      except (ValueError, SyntaxError):
        overrides[k] = v
  if overrides and name not in ('stats_on', 'stats_off'):
    if IMPLS[name][0] != 'torch' or set(overrides) - {'grad_accum_steps'}:
      raise ValueError(
          'config overrides apply to stats_on/stats_off only (PyTorch steps '
          f'take grad_accum_steps), got {spec!r}'
      )
  return name, overrides, env


# ------------------------------------------------------------------------------
# Child: one implementation, one process.


def _torch_peak(threads: int) -> dict[str, Any]:
  import torch

  torch.set_num_threads(threads)
  by = {}
  for n in (1024, 2048):
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    a @ b
    ts = []
    for _ in range(5):
      t0 = time.perf_counter()
      a @ b
      ts.append(time.perf_counter() - t0)
    by[str(n)] = 2.0 * n**3 / statistics.median(ts)
  return {
      'flops_per_s': max(by.values()),
      'by_size': by,
      'dtype': 'float32',
      'threads': torch.get_num_threads(),
  }


def _time_wall_and_cpu(
    fn, steps_n: int, warmup: int
) -> tuple[list[float], list[float]]:
  """Wall and process CPU seconds (all threads, user + system) of each timed
  call."""
  from benchmarks import common

  for _ in range(warmup):
    common.block(fn())
  wall = []
  cpu = []
  for _ in range(steps_n):
    c0 = time.process_time()
    t0 = time.perf_counter()
    common.block(fn())
    wall.append(time.perf_counter() - t0)
    cpu.append(time.process_time() - c0)
  return wall, cpu


def child(
    spec: str, shape_name: str, steps_n: int, warmup: int, threads: int
) -> dict[str, Any]:
  """Builds and times one implementation in this process; returns a JSON-able
  dict."""
  name, overrides, _ = parse_spec(spec)
  from benchmarks import common

  shape = {'small': common.SMALL, 'tiny': common.TINY, 'mini': common.MINI}[
      shape_name
  ]
  fw = IMPLS[name][0]
  out: dict[str, Any] = {
      'spec': spec,
      'impl': name,
      'framework': fw,
      'pid': os.getpid(),
      'affinity': sorted(os.sched_getaffinity(0)),
  }
  if name == 'peak_jax':
    out['peak'] = common.matmul_peak('float32', (1024, 2048), repeats=5)
    return out
  if name == 'peak_torch':
    out['peak'] = _torch_peak(threads)
    return out
  from benchmarks import steps

  t0 = time.perf_counter()
  if name in ('stats_on', 'stats_off'):
    runner = steps.library_train(shape, name == 'stats_on', **overrides)
  elif name == 'reference':
    runner = steps.reference_train(shape)
  elif name == 'hf_flax':
    runner = steps.hf_flax_train(shape)
  else:
    runner = steps.torch_train(
        shape, name == 'torch_compile', threads=threads, **overrides
    )
  out['build_s'] = time.perf_counter() - t0
  ts, cpu = _time_wall_and_cpu(runner.call, steps_n, warmup)
  out.update(common.summarize(ts))
  out['times_s'] = ts
  out['cpu_times_s'] = cpu
  out['median_cpu_s'] = statistics.median(cpu)
  out['tokens'] = shape.tokens
  out['flops_per_token'] = common.flops_per_token(shape, runner.n_params_no_pos)
  out['name'] = runner.name
  out['note'] = runner.note
  if fw == 'torch':
    import torch

    out['threads'] = torch.get_num_threads()
  return out


# ------------------------------------------------------------------------------
# Parent: rounds, rotation, aggregation.


def _run_child(
    spec: str, a: argparse.Namespace, cpus: list[int]
) -> dict[str, Any]:
  _, _, env_over = parse_spec(spec)
  env = dict(os.environ)
  env.update(
      {
          'OMP_NUM_THREADS': str(a.threads),
          'MKL_NUM_THREADS': str(a.threads),
          'JAX_PLATFORMS': env.get('JAX_PLATFORMS', 'cpu'),
          'PYTHONUNBUFFERED': '1',
      }
  )
  env.update(env_over)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env['PYTHONPATH'] = root + (
      os.pathsep + env['PYTHONPATH'] if env.get('PYTHONPATH') else ''
  )
  cmd = [
      sys.executable,
      '-m',
      'benchmarks.per_process',
      '--child',
      spec,
      '--shape',
      a.shape,
      '--steps',
      str(a.steps),
      '--warmup',
      str(a.warmup),
      '--threads',
      str(a.threads),
      '--cpus',
      ','.join(map(str, cpus)),
  ]
  t0 = time.perf_counter()
  p = subprocess.run(
      cmd,
      env=env,
      cwd=root,
      capture_output=True,
      text=True,
      timeout=a.child_timeout,
  )
  wall = time.perf_counter() - t0
  lines = [line for line in p.stdout.splitlines() if line.startswith('{"spec"')]
  if p.returncode != 0 or not lines:
    tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
    return {
        'spec': spec,
        'error': f'exit {p.returncode}: ' + ' | '.join(tail)[-400:],
        'process_wall_s': wall,
    }
  res = json.loads(lines[-1])
  res['process_wall_s'] = wall
  return res


def _spread(xs: list[float]) -> dict[str, Any]:
  return (
      {
          'median': statistics.median(xs),
          'min': min(xs),
          'max': max(xs),
          'n': len(xs),
          'values': xs,
      }
      if xs
      else {}
  )


def aggregate(
    specs: list[str], rounds: list[dict[str, dict[str, Any]]], ratio_to: str
) -> dict[str, Any]:
  """Per-implementation spreads over rounds, MFU against the framework's peak,
  paired ratios."""
  peaks = {'jax': [], 'torch': []}
  for r in rounds:
    for fw, key in (('jax', 'peak_jax'), ('torch', 'peak_torch')):
      if key in r and 'peak' in r[key]:
        peaks[fw].append(r[key]['peak']['flops_per_s'])
  rows = []
  for spec in specs:
    name = parse_spec(spec)[0]
    if name.startswith('peak_'):
      continue
    fw = IMPLS[name][0]
    res = [r.get(spec, {}) for r in rounds]
    ok = [x for x in res if 'median_s' in x]
    row: dict[str, Any] = {
        'spec': spec,
        'label': (
            IMPLS[name][1]
            + (f" [{spec.partition(':')[2]}]" if ':' in spec else '')
        ),
        'framework': fw,
    }
    errors = [x['error'] for x in res if 'error' in x]
    if errors:
      row['errors'] = errors
    if not ok:
      rows.append(row)
      continue
    tps = [x['tokens'] / x['median_s'] for x in ok]
    cpu = [x['tokens'] / x['median_cpu_s'] for x in ok if 'median_cpu_s' in x]
    # less sensitive to other jobs on the machine, but counts spinning threads
    # too
    if cpu:
      row['tokens_per_cpu_s'] = _spread(cpu)
    # The defaults: what auto resolved to.
    if ok[0].get('note') and not parse_spec(spec)[1]:
      row['label'] += f", defaults ({ok[0]['note']})"
    row.update(
        {
            'name': ok[0]['name'],
            'tokens_per_s': _spread(tps),
            'step_s': _spread([x['median_s'] for x in ok]),
            'within_round_rel_spread': _spread(
                [(x['max_s'] - x['min_s']) / x['median_s'] for x in ok]
            ),
            'flops_per_token': ok[0]['flops_per_token'],
            'threads': ok[0].get('threads'),
        }
    )
    if peaks[fw]:
      pk = statistics.median(peaks[fw])
      row['mfu'] = statistics.median(tps) * ok[0]['flops_per_token'] / pk
    ratios = []
    for r in rounds:
      mine = r.get(spec, {})
      ref = r.get(ratio_to, {})
      if 'median_s' in mine and 'median_s' in ref:
        ratios.append(ref['median_s'] / mine['median_s'])
    if ratios:
      row['ratio_to_' + ratio_to] = _spread(ratios)
    cpu_ratios = [
        r[ratio_to]['median_cpu_s'] / r[spec]['median_cpu_s']
        for r in rounds
        if 'median_cpu_s' in r.get(spec, {})
        and 'median_cpu_s' in r.get(ratio_to, {})
    ]
    if cpu_ratios:
      row['cpu_time_ratio_to_' + ratio_to] = _spread(cpu_ratios)
    rows.append(row)
  return {'rows': rows, 'peaks': {fw: _spread(v) for fw, v in peaks.items()}}


def _fmt(x: float) -> str:
  return f'{x / 1e3:.2f}k'


def markdown(result: dict[str, Any]) -> str:
  """The README table: tokens/s median (min-max over rounds), MFU, paired
  ratio."""
  ag = result['aggregate']
  o = result['options']
  rt = o['ratio_to']
  m = result['machine']
  lines = [
      (
          f"Per-process runs: shape {o['shape']}, {o['rounds']} rounds x"
          f" {o['steps']} timed steps (after {o['warmup']} warm-up), rotating"
          f" order, {o['threads']} threads, CPUs {o['cpus']}; {m.get('cpu')}"
          f" ({m.get('cpu_count')} cores); jax {m.get('jax')}, torch"
          f" {m.get('torch')}, transformers {m.get('transformers')}."
      ),
      '',
  ]
  pk = ag['peaks']
  pk_txt = '; '.join(
      f"{fw} {v['median'] / 1e9:.0f} GFLOP/s ({v['min'] / 1e9:.0f}-"
      f"{v['max'] / 1e9:.0f})"
      for fw, v in pk.items()
      if v
  )
  lines += [
      (
          'fp32 matmul peak, own process per framework, median (min-max) over'
          f' rounds: {pk_txt or "not measured"}.'
      ),
      '',
      (
          '| implementation | tokens/s median (min-max over rounds) | MFU (own'
          f' framework peak) | vs {rt} (paired per round) | tokens per'
          f' CPU-second (median) | vs {rt}, CPU time |'
      ),
      '|---|---|---|---|---|---|',
  ]
  for r in ag['rows']:
    if 'tokens_per_s' not in r:
      why = r.get('errors', ['no result'])[0]
      lines.append(f"| {r['label']} | absent: {why[:160]} | | | | |")
      continue
    t = r['tokens_per_s']
    ratio = r.get('ratio_to_' + rt)
    rtxt = (
        f"{ratio['median']:.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f})"
        if ratio
        else '-'
    )
    mfu = f"{100 * r['mfu']:.1f}%" if 'mfu' in r else '-'
    cpu = r.get('tokens_per_cpu_s')
    cr = r.get('cpu_time_ratio_to_' + rt)
    crtxt = f"{cr['median']:.2f}x" if cr else '-'
    lines.append(
        f"| {r['label']} | {_fmt(t['median'])}"
        f" ({_fmt(t['min'])}-{_fmt(t['max'])}) | {mfu} | {rtxt} |"
        f" {_fmt(cpu['median']) if cpu else '-'} | {crtxt} |"
    )
  return '\n'.join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument(
      '--impls', default=DEFAULT_IMPLS, help='comma-separated specs (see above)'
  )
  p.add_argument(
      '--no_peaks', action='store_true', help='skip the matmul peak processes'
  )
  p.add_argument('--shape', default='small', choices=SHAPES)
  p.add_argument('--rounds', type=int, default=4)
  p.add_argument('--steps', type=int, default=15)
  p.add_argument('--warmup', type=int, default=3)
  p.add_argument(
      '--threads', type=int, default=0, help='0 = number of CPUs in --cpus'
  )
  p.add_argument(
      '--cpus',
      default='',
      help=(
          "CPU affinity of every process, e.g. '0-1' or "
          "'0,1' (default: this process's affinity)"
      ),
  )
  p.add_argument(
      '--ratio_to', default='torch_compile', help='spec the ratios are taken to'
  )
  p.add_argument('--out', default='benchmarks/results/cpu_per_process.json')
  p.add_argument('--child_timeout', type=float, default=1800)
  p.add_argument('--child', default='', help=argparse.SUPPRESS)
  return p.parse_args(argv)


def _parse_cpus(text: str) -> list[int]:
  if not text:
    return sorted(os.sched_getaffinity(0))
  out = []
  for part in text.split(','):
    lo, _, hi = part.partition('-')
    out += list(range(int(lo), int(hi or lo) + 1))
  return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
  a = parse_args(argv)
  cpus = _parse_cpus(a.cpus)
  a.threads = a.threads or len(cpus)
  if a.child:
    os.sched_setaffinity(0, cpus)
    res = child(a.child, a.shape, a.steps, a.warmup, a.threads)
    print(json.dumps(res))
    return res
  specs = split_specs(a.impls)
  for s in specs:
    parse_spec(s)  # fail early on a typo
  if not a.no_peaks:
    specs += [p for p in ('peak_jax', 'peak_torch') if p not in specs]
  # after the children's env is settled; parent never times
  from benchmarks import common

  rounds = []
  t0 = time.perf_counter()
  for i in range(a.rounds):
    k = i % len(specs)
    order = specs[k:] + specs[:k]
    got = {}
    for spec in order:
      res = _run_child(spec, a, cpus)
      got[spec] = res
      if 'median_s' in res:
        msg = f"{res['tokens'] / res['median_s']:.0f} tokens/s"
      elif 'peak' in res:
        msg = f"peak {res['peak']['flops_per_s'] / 1e9:.0f} GFLOP/s"
      else:
        msg = res.get('error', '?')
      print(
          f'[per_process] round {i + 1}/{a.rounds} {spec}: {msg}',
          file=sys.stderr,
          flush=True,
      )
    rounds.append({'order': order, **got})
  result = {
      'machine': common.machine_info(),
      'started': time.strftime('%Y-%m-%dT%H:%M:%S%z'),
      'options': {
          'impls': specs,
          'shape': a.shape,
          'rounds': a.rounds,
          'steps': a.steps,
          'warmup': a.warmup,
          'threads': a.threads,
          'cpus': cpus,
          'ratio_to': a.ratio_to,
      },
      'wall_s': time.perf_counter() - t0,
      'rounds': rounds,
  }
  result['aggregate'] = aggregate(specs, rounds, a.ratio_to)
  if a.out:
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, 'w') as f:
      json.dump(result, f, indent=1, default=str)
  print(markdown(result))
  return result


if __name__ == '__main__':
  main()
