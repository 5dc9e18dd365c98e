"""Cross-suite ratios and the markdown table for the README, from a `run.py`
result dict."""

from __future__ import annotations

from typing import Any


def _pipeline_rates(node: Any, path: str = '') -> dict[str, float]:
  """Every `tokens_per_s` number inside the data suite's output, keyed by its
  path."""
  out = {}
  if isinstance(node, dict):
    for k, v in node.items():
      if k == 'tokens_per_s' and isinstance(v, (int, float)):
        out[path or 'data'] = float(v)
      else:
        out.update(_pipeline_rates(v, f'{path}/{k}' if path else str(k)))
  elif isinstance(node, list):
    for i, v in enumerate(node):
      label = v.get('policy', v.get('name', i)) if isinstance(v, dict) else i
      out.update(_pipeline_rates(v, f'{path}/{label}' if path else str(label)))
  return out


def _train_rate(s: dict[str, Any]) -> tuple[float | None, str]:
  """Train tokens/s (stats on, main shape) from whichever suite measured it."""
  for name in ('side_by_side', 'train', 'eval'):
    r = s.get(name, {})
    if name == 'side_by_side' and r.get('rows'):
      return r['rows'][0]['tokens_per_s'], 'side_by_side'
    if name == 'train' and r.get('shapes'):
      first = next(iter(r['shapes'].values()))
      return first['rows'][0]['tokens_per_s'], 'train'
    if name == 'eval' and r.get('train'):
      return r['train']['tokens_per_s'], 'eval'
  return None, ''


def summary(result: dict[str, Any]) -> dict[str, Any]:
  """Headline ratios against the issue's targets (only those whose suites
  ran)."""
  s = result['suites']
  out = {}
  train, src = _train_rate(s)
  if train:
    out['train_tokens_per_s'] = train
    out['train_tokens_per_s_from'] = src
  if 'overhead' in s and 'overhead_ci95' in s['overhead']:
    o = s['overhead']
    out['stats_overhead'] = {
        'median': o['overhead_median'],
        'ci95': o['overhead_ci95'],
        'meets_target_le_3pct': o['meets_target'],
    }
  sbs = s.get('side_by_side', {})
  if sbs.get('rows') and sbs.get('fastest_peer'):
    lib = sbs['rows'][0]
    out['vs_fastest_peer'] = {
        'peer': sbs['fastest_peer'],
        'ratio': lib['ratio_to_fastest_peer'],
        'meets_target_ge_1.1': bool(lib['ratio_to_fastest_peer'] >= 1.1),
    }
  if 'eval' in s and 'eval_over_train' in s['eval']:
    out['eval_over_train'] = s['eval']['eval_over_train']
  if 'data' in s:
    ratios = {}
    for k, v in _pipeline_rates(s['data']).items():
      ref = _train_rate_for(
          s, k.split('/')[1] if k.startswith('shapes/') else ''
      )
      if ref:
        ratios[k] = v / ref
    if ratios:
      out['pipeline_over_train'] = ratios
  return out


def _train_rate_for(s: dict[str, Any], shape_name: str) -> float | None:
  """Train tokens/s (stats on) measured on the shape called `shape_name`, if any
  suite did."""
  tr = s.get('train', {}).get('shapes', {})
  if shape_name in tr:
    return tr[shape_name]['rows'][0]['tokens_per_s']
  ac = s.get('accel', {})
  if ac.get('rows') and ac.get('shape', {}).get('name') == shape_name:
    return ac['rows'][0]['tokens_per_s']
  return None


def _fmt_rate(x: float) -> str:
  return f'{x / 1e3:.2f}k' if x < 1e6 else f'{x / 1e6:.2f}M'


def markdown(result: dict[str, Any]) -> str:
  """README-ready markdown: machine line, then one table per suite that ran."""
  m = result['machine']
  s = result['suites']
  lines = [
      (
          f"Machine: {m.get('cpu')} ({m.get('cpu_count')} cores), backend"
          f" {m.get('backend')}; jax {m.get('jax')}, flax {m.get('flax')},"
          f" optax {m.get('optax')}, transformers {m.get('transformers')},"
          f" torch {m.get('torch')}; run {result.get('started')}."
      ),
      '',
  ]
  sbs = s.get('side_by_side', {})
  if sbs.get('rows'):
    sh = sbs['shape']
    pk = sbs['peak']['flops_per_s'] / 1e9
    lines += [
        (
            'DIAGNOSTIC (in-process round-robin, thread pools compete; not the'
            ' published comparison, see `python -m benchmarks.per_process`):'
        ),
        '',
        (
            f"Train step, shape {sh['name']} (V={sh['vocab_size']},"
            f" L={sh['num_layers']}, H={sh['num_heads']}, D={sh['emb_dim']},"
            f" T={sh['seq_len']}, B={sh['batch_size']}, {sh['dtype']}); matmul"
            f" peak {pk:.0f} GFLOP/s; median of {sbs['rows'][0]['n']} steps"
            ' (min-max):'
        ),
        '',
        '| implementation | tokens/s (min-max) | MFU | vs fastest peer |',
        '|---|---|---|---|',
    ]
    for r in sbs['rows']:
      ratio = r.get('ratio_to_fastest_peer')
      ratio_text = f'{ratio:.2f}x' if ratio else '-'
      lines.append(
          f"| {r['name']} | {_fmt_rate(r['tokens_per_s'])}"
          f" ({_fmt_rate(r['tokens_per_s_min'])}"
          f"-{_fmt_rate(r['tokens_per_s_max'])})"
          f" | {100 * r['mfu']:.1f}% | {ratio_text} |"
      )
    for k, v in sbs.get('skipped', {}).items():
      lines.append(f'| {k} | skipped: {v} | | |')
    lines.append('')
  tr = s.get('train', {})
  if tr.get('shapes'):
    lines += [
        '| shape | stats | tokens/s (min-max) | MFU |',
        '|---|---|---|---|',
    ]
    for name, v in tr['shapes'].items():
      for r in v['rows']:
        lines.append(
            f"| {name} | {'on' if 'on' in r['name'] else 'off'} |"
            f" {_fmt_rate(r['tokens_per_s'])}"
            f" ({_fmt_rate(r['tokens_per_s_min'])}"
            f"-{_fmt_rate(r['tokens_per_s_max'])})"
            f" | {100 * r['mfu']:.1f}% |"
        )
    lines.append('')
  summ = result.get('summary', {})
  rows = []
  if 'stats_overhead' in summ:
    o = summ['stats_overhead']
    rows.append(
        f"| statistics overhead (median of {s['overhead']['blocks']}"
        f" alternating blocks, 95% bootstrap CI) | {100 * o['median']:+.1f}%"
        f" [{100 * o['ci95'][0]:+.1f}%, {100 * o['ci95'][1]:+.1f}%] | <= 3%"
        ' (upper) |'
    )
  if 'vs_fastest_peer' in summ:
    v = summ['vs_fastest_peer']
    rows.append(
        f"| train tokens/s / fastest peer ({v['peer']}), in-process diagnostic"
        f" | {v['ratio']:.2f}x | >= 1.1x (judged per process) |"
    )
  if 'eval_over_train' in summ:
    rows.append(
        f"| eval tokens/s / train tokens/s | {summ['eval_over_train']:.1f}x |"
        ' >= 3x |'
    )
  for k, v in summ.get('pipeline_over_train', {}).items():
    k = k.removeprefix('shapes/').replace('/rows/', ' ')
    rows.append(
        f'| input pipeline {k} / train tokens/s (same shape) | {v:.1f}x | >='
        ' 10x |'
    )
  if rows:
    lines += [
        '| ratio (same run) | measured | target |',
        '|---|---|---|',
        *rows,
        '',
    ]
  sc = s.get('scaling', {})
  if sc.get('context'):
    lines += [
        (
            '| sweep | T | D | B | step ms | tokens/s | MFU | temp MiB (stats'
            ' on/off) | stats extra KiB |'
        ),
        '|---|---|---|---|---|---|---|---|---|',
    ]
    for kind in ('context', 'width', 'batch'):
      for r in sc[kind]:
        st = r.get('step')
        on = r.get('memory_stats_on') or {}
        off = r.get('memory_stats_off') or {}
        lines.append(
            f"| {kind} | {r['seq_len']} | {r['emb_dim']} | {r['batch_size']} | "
            f"{1e3 * st['median_s']:.1f} | {_fmt_rate(st['tokens_per_s'])} | "
            f"{100 * st['mfu']:.1f}% | "
            if st
            else (
                f"| {kind} | {r['seq_len']} | {r['emb_dim']} |"
                f" {r['batch_size']} | - | - | - | "
            )
        )
        lines[-1] += (
            f"{on.get('temp', 0) / 2**20:.1f} /"
            f" {off.get('temp', 0) / 2**20:.1f} |"
            f" {r.get('stats_extra_bytes', 0) / 1024:.1f} |"
        )
    if sc.get('stats_memory'):
      lines += ['', f"Statistics memory: {sc['stats_memory']['reading']}.", '']
  ac = s.get('accel', {})
  if ac.get('rows'):
    pk = ac['peak']['flops_per_s'] / 1e12
    lines += [
        (
            f"Accelerator ({ac['devices'][0]}), {ac['shape']['name']}"
            f" {ac['shape']['dtype']}, bf16 matmul peak {pk:.0f} TFLOP/s:"
        ),
        '',
        '| variant | tokens/s | MFU | compiled temp / peak memory (GiB) |',
        '|---|---|---|---|',
    ]
    for r in ac['rows']:
      mem = r.get('memory') or {}
      mtxt = (
          f"{mem.get('temp', 0) / 2**30:.2f} / {mem.get('peak', 0) / 2**30:.2f}"
          if mem
          else '-'
      )
      lines.append(
          f"| {r['variant']} | {_fmt_rate(r['tokens_per_s'])} |"
          f" {100 * r['mfu']:.1f}% | {mtxt} |"
      )
    for k, v in ac.get('failed', {}).items():
      lines.append(f'| {k} | {v} | | |')
  elif 'skipped' in ac:
    lines.append(f"Accelerator mode: skipped ({ac['skipped']}).")
  return '\n'.join(lines)
