"""Per-op profile of one train step: ours (jax.profiler + the compiled HLO) next
to PyTorch's.

  python -m benchmarks.profile_step                                  # stats_off
  + torch_compile python -m benchmarks.profile_step --impls
  stats_on,stats_off:model.attention_impl=blocked python -m
  benchmarks.profile_step --out benchmarks/results/profile_small.json

JAX: `jax.profiler.trace` around `--steps` steps; every XLA:CPU thunk event
(named after the HLO instruction it runs) is summed over threads and steps, then
mapped to a category through that instruction's `op_name` metadata in the
compiled HLO (`compiled.as_text()`): dense-layer matmuls, attention, layer norm,
GELU, tied head/embedding, loss, optimizer and step bookkeeping, statistics.
Times are thread-seconds per step (the pool has one thread per core, so they add
up to about cores x wall time when the pool is busy); shares are what matters.
The compiled `cost_analysis()` (FLOPs, bytes accessed) is reported alongside: it
does not depend on the machine's load.

PyTorch: `torch.profiler.profile` (CPU activities) around the same number of
steps of the HF GPT2LMHeadModel step; the top ops by self CPU time.

Each implementation is profiled in its own process (`benchmarks.per_process`
specs)."""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Any

CATEGORIES = (
    # (category, regex on the instruction's op_name), first match wins.
    (
        'attention',
        r'dot_product_attention|bnts|btnh|bnq|bnk|tril|/vmap\(\)|'
        r'blocked_causal|attention/|/softmax(?!_cross)|/swapaxes|'
        r'block_\d+/(reduce_max|exp|sub|div|and|ge|eq|'
        r'select_n|stop_gradient|concatenate|slice|transpose|log_softmax)$',
    ),
    ('layer norm', r'/ln_\d|/ln_f|layer_?norm'),
    (
        'dense matmul (qkv, attn_out, mlp_in, mlp_out)',
        r'/(qkv|attn_out|mlp_in|mlp_out)/.*dot_general',
    ),
    (
        'dense bias / residual adds',
        r'/(qkv|attn_out|mlp_in|mlp_out)/|block_\d+/add',
    ),
    ('GELU', r'tanh|gelu|integer_pow'),
    ('tied head + embeddings', r'token_embed|pos_embed|attend|_take|embed'),
    (
        'loss (softmax cross entropy)',
        r'softmax_cross_entropy|log_softmax|logsumexp|reduce_max|exp',
    ),
    ('statistics', r'segment_sum|scatter|position_stats|occurrence|loss_stats'),
    (
        'optimizer + update',
        r'clip|adam|decay|apply_updates|sqrt|norm|'
        r'^(add|mul|div|sub|select_n|convert_element_type|square|min|max|cos|'
        r'reduce_sum)$',
    ),
)


def _instruction_index(hlo_text: str) -> dict[str, dict[str, Any]]:
  """Instruction name -> {'op_name', 'opcode', 'dot'} for every instruction in
  the HLO text."""
  comps: dict[str, list[str]] = {}
  cur = None
  for line in hlo_text.splitlines():
    m = re.match(r'^(?:ENTRY )?%?([\w.\-]+) .*\{$', line)
    if m and not line.startswith(' '):
      cur = m.group(1)
      comps[cur] = []
    elif cur is not None:
      comps[cur].append(line)
  idx = {}
  for lines in comps.values():
    for line in lines:
      m = re.match(
          r'^\s*(?:ROOT )?%([\w.\-]+) = \S+(?:\{[^}]*\})? ([\w\-]+)\(', line
      )
      if not m:
        m = re.match(r'^\s*(?:ROOT )?%([\w.\-]+) = .*? ([\w\-]+)\(', line)
      if not m:
        continue
      name = m.group(1)
      opcode = m.group(2)
      op = re.search(r'op_name="([^"]*)"', line)
      calls = re.search(r'calls=%([\w.\-]+)', line)
      has_dot = opcode in ('dot', 'convolution') or bool(
          calls
          and any(' dot(' in line for line in comps.get(calls.group(1), []))
      )
      idx[name] = {
          'op_name': op.group(1) if op else '',
          'opcode': opcode,
          'dot': has_dot,
      }
  return idx


def categorize(op_name: str, has_dot: bool) -> str:
  s = re.sub(r'^jit\([^)]*\)/', '', op_name)
  in_model = 'TransformerLM' in s or 'jvp(' in s
  s_short = re.sub(r'(transpose\()?jvp\(TransformerLM\)\)?/?', '', s)
  for cat, pat in CATEGORIES:
    if cat.startswith('optimizer') and in_model:
      continue
    if re.search(pat, s_short if cat.startswith('optimizer') else s, re.I):
      if cat.startswith('dense matmul') and not has_dot:
        continue
      return cat
  if has_dot:
    return 'other matmul'
  return 'other (model)' if in_model else 'optimizer + update'


def profile_jax(
    spec: str, shape_name: str, steps_n: int, top: int
) -> dict[str, Any]:
  import jax
  from jax.profiler import ProfileData

  from benchmarks import common
  from benchmarks import per_process
  from benchmarks import steps

  name, overrides, _ = per_process.parse_spec(spec)
  shape = {'small': common.SMALL, 'tiny': common.TINY, 'mini': common.MINI}[
      shape_name
  ]
  if name in ('stats_on', 'stats_off'):
    runner = steps.library_train(shape, name == 'stats_on', **overrides)
  elif name == 'reference':
    runner = steps.reference_train(shape)
  else:
    raise ValueError(f'profile_jax: {spec!r} is not a JAX step of this project')
  compiled = runner.lower().compile()
  idx = _instruction_index(compiled.as_text())
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  for _ in range(2):
    common.block(runner.call())
  d = tempfile.mkdtemp()
  with jax.profiler.trace(d):
    for _ in range(steps_n):
      common.block(runner.call())
  f = glob.glob(os.path.join(d, '**', '*.xplane.pb'), recursive=True)[0]
  per_instr = collections.Counter()
  wall = 0
  for plane in ProfileData.from_file(f).planes:
    for line in plane.lines:
      for ev in line.events:
        if ev.name in idx:
          per_instr[ev.name] += ev.duration_ns
        elif ev.name.startswith('ThunkExecutor::Execute (wait'):
          wall += ev.duration_ns
  total = sum(per_instr.values())
  cats = collections.Counter()
  by_name = collections.Counter()
  name_cat = {}
  for k, v in per_instr.items():
    cat = categorize(idx[k]['op_name'], idx[k]['dot'])
    cats[cat] += v
    short = re.sub(
        r'block_\d+',
        'block_*',
        re.sub(r'^jit\([^)]*\)/', '', idx[k]['op_name']),
    )
    by_name[short] += v
    # from a real op_name: the patterns need block_<digit>
    name_cat.setdefault(short, cat)
  return {
      'spec': spec,
      'framework': 'jax',
      'steps': steps_n,
      'thread_ms_per_step': total / 1e6 / steps_n,
      'flops': float(cost.get('flops', 0)),
      'bytes_accessed': float(cost.get('bytes accessed', 0)),
      'categories': [
          {'category': c, 'ms_per_step': v / 1e6 / steps_n, 'share': v / total}
          for c, v in cats.most_common()
      ],
      'top_ops': [
          {
              'op': k,
              'opcode': idx[k]['opcode'],
              'op_name': idx[k]['op_name'][:160],
              'category': categorize(idx[k]['op_name'], idx[k]['dot']),
              'ms_per_step': v / 1e6 / steps_n,
              'share': v / total,
          }
          for k, v in per_instr.most_common(top)
      ],
      'by_op_name': [
          {
              'op_name': k[:200],
              'category': name_cat[k],
              'ms_per_step': v / 1e6 / steps_n,
              'share': v / total,
          }
          for k, v in by_name.most_common(3 * top)
      ],
  }


def profile_torch(
    spec: str, shape_name: str, steps_n: int, top: int
) -> dict[str, Any]:
  import torch

  from benchmarks import common
  from benchmarks import per_process
  from benchmarks import steps

  name, _, _ = per_process.parse_spec(spec)
  shape = {'small': common.SMALL, 'tiny': common.TINY, 'mini': common.MINI}[
      shape_name
  ]
  runner = steps.torch_train(shape, name == 'torch_compile')
  for _ in range(3):
    runner.call()
  with torch.profiler.profile(
      activities=[torch.profiler.ProfilerActivity.CPU]
  ) as prof:
    for _ in range(steps_n):
      runner.call()
  ev = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
  total = sum(e.self_cpu_time_total for e in ev)
  ev.sort(key=lambda e: -e.self_cpu_time_total)
  return {
      'spec': spec,
      'framework': 'torch',
      'steps': steps_n,
      'self_cpu_ms_per_step': total / 1e3 / steps_n,
      'top_ops': [
          {
              'op': e.key,
              'calls_per_step': e.count / steps_n,
              'ms_per_step': e.self_cpu_time_total / 1e3 / steps_n,
              'share': e.self_cpu_time_total / total,
          }
          for e in ev[:top]
      ],
  }


def markdown(results: list[dict[str, Any]]) -> str:
  lines = []
  for r in results:
    if 'error' in r:
      lines += [f"### {r['spec']}: failed: {r['error']}", '']
      continue
    if r['framework'] == 'jax':
      lines += [
          (
              f"### {r['spec']} (JAX; {r['thread_ms_per_step']:.0f}"
              f" thread-ms/step; cost analysis {r['flops'] / 1e9:.1f} GFLOP,"
              f" {r['bytes_accessed'] / 1e9:.2f} GB accessed per step; XLA"
              " counts a while loop's body once, so under grad_accum_steps"
              ' these are per microbatch)'
          ),
          '',
          '| category | thread-ms/step | share |',
          '|---|---|---|',
      ]
      lines += [
          f"| {c['category']} | {c['ms_per_step']:.1f} |"
          f" {100 * c['share']:.1f}% |"
          for c in r['categories']
      ]
      lines += [
          '',
          '| top op | category | op_name | share |',
          '|---|---|---|---|',
      ]
      lines += [
          f"| {o['op']} | {o['category']} | `{o['op_name'][:90]}` |"
          f" {100 * o['share']:.1f}% |"
          for o in r['top_ops']
      ]
    else:
      lines += [
          (
              f"### {r['spec']} (PyTorch; {r['self_cpu_ms_per_step']:.0f}"
              ' self-CPU ms/step)'
          ),
          '',
          '| top op | calls/step | ms/step | share |',
          '|---|---|---|---|',
      ]
      lines += [
          f"| {o['op']} | {o['calls_per_step']:.0f} | {o['ms_per_step']:.1f} | "
          f"{100 * o['share']:.1f}% |"
          for o in r['top_ops']
      ]
    lines.append('')
  return '\n'.join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
  p = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument('--impls', default='stats_off,torch_compile')
  p.add_argument('--shape', default='small')
  p.add_argument('--steps', type=int, default=3)
  p.add_argument('--top', type=int, default=15)
  p.add_argument('--out', default='benchmarks/results/profile_small.json')
  p.add_argument('--child', default='', help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  if a.child:
    fn = profile_torch if a.child.startswith('torch') else profile_jax
    print('@@' + json.dumps(fn(a.child, a.shape, a.steps, a.top)))
    return []
  from benchmarks import per_process

  results = []
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  for spec in filter(None, a.impls.split(',')):
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get('JAX_PLATFORMS', 'cpu'))
    env.update(per_process.parse_spec(spec)[2])
    env['PYTHONPATH'] = root + (
        os.pathsep + env['PYTHONPATH'] if env.get('PYTHONPATH') else ''
    )
    proc = subprocess.run(
        [
            sys.executable,
            '-m',
            'benchmarks.profile_step',
            '--child',
            spec,
            '--shape',
            a.shape,
            '--steps',
            str(a.steps),
            '--top',
            str(a.top),
        ],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
    )
    out = [line for line in proc.stdout.splitlines() if line.startswith('@@')]
    if proc.returncode or not out:
      err = (proc.stderr.strip().splitlines() or ['?'])[-1]
      results.append(
          {'spec': spec, 'error': f'exit {proc.returncode}: {err[:300]}'}
      )
    else:
      results.append(json.loads(out[-1][2:]))
  if a.out:
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, 'w') as f:
      json.dump(results, f, indent=1)
  print(markdown(results))
  return results


if __name__ == '__main__':
  main()
