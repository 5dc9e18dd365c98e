"""Position-exposure report: how often each position id carries a real token.

Run it before training to see the skew a policy produces:

  python -m flax_posemb.data --config configs/tiny.py --num_batches 100 \
      [--json exposure.json] [--png exposure.png]
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flax_posemb.data import pipeline


def _length_buckets(seq_len: int, n: int = 6) -> list[tuple[int, int]]:
  """Buckets ``(lo, hi]`` of lengths: 1/32, 1/16, 1/8, 1/4, 1/2, 1 of the context."""
  edges = [0] + [max(1, int(round(seq_len / 2**(n - 1 - i)))) for i in range(n)]
  return [(lo, hi) for lo, hi in zip(edges[:-1], edges[1:]) if hi > lo]


def _hist(lengths: np.ndarray, seq_len: int) -> list[dict[str, Any]]:
  """Documents and token share per length bucket; lengths ``[n]`` in pairs."""
  total = max(int(lengths.sum()), 1)
  out = []
  for lo, hi in _length_buckets(seq_len):
    sel = (lengths > lo) & (lengths <= hi)
    out.append({'bucket': f'({lo},{hi}]', 'docs': int(sel.sum()),
                'token_share': float(lengths[sel].sum() / total)})
  return out


def _segment_lengths(batch: dict[str, np.ndarray]) -> list[int]:
  seg = batch['segment_ids']
  out = []
  for row in seg:
    ids, counts = np.unique(row[row > 0], return_counts=True)
    out += counts.tolist()
  return out


def exposure(config, num_batches: int = 100, num_source_docs: int = 2000) -> dict[str, Any]:
  """Exposure of the training iterator of `config` (the full config: data + batch fields).

  Args:
    config: full config (`config.data`, `config.batch_size`, `config.seed`,
      `config.num_train_steps`).
    num_batches: batches drawn from the training iterator.
    num_source_docs: documents sampled from the source for its length distribution.

  Returns:
    JSON-serializable dict: 'counts' (real tokens per position, ``[seq_len]``), 'deciles'
    (mean count per decile of positions, ``[10]``), 'last_over_first', padding fraction,
    'segment_lengths' (per row segment, bucketed) and 'doc_lengths' (source documents,
    truncated to the context, bucketed).
  """
  if int(num_batches) < 1:
    raise ValueError(f'num_batches must be >= 1 (a report on no batches says nothing), got '
                     f'{num_batches}.')
  c = config.data
  pipeline.validate_config(c, max_len=int(config.model.max_len))
  t = int(c.seq_len)
  it = pipeline.make_train_iterator(c, batch_size=int(config.batch_size), seed=int(config.seed),
                                    num_train_steps=int(config.num_train_steps))
  counts = np.zeros(t, np.int64)
  slots, seg_lens = 0, []
  for _ in range(num_batches):
    b = next(it)
    real = b['segment_ids'] > 0
    np.add.at(counts, b['positions'][real], 1)
    slots += real.size
    seg_lens += _segment_lengths(b)
  deciles = np.array([x.mean() for x in np.array_split(counts.astype(np.float64), 10)])
  src = pipeline.make_source(c, c.train_split)
  order = pipeline.DocOrder(len(src), int(config.seed), True)
  doc_lens = np.array([max(len(src.doc(order[i], max_pairs=t)) - 1, 0)
                       for i in range(min(num_source_docs, len(src)))])
  return {
      'source': c.source, 'name': c.name, 'policy': c.position_policy, 'seq_len': t,
      'batch_size': int(config.batch_size), 'num_batches': int(num_batches),
      'real_tokens': int(counts.sum()), 'token_slots': int(slots),
      'padding_fraction': float(1 - counts.sum() / max(slots, 1)),
      'counts': counts.tolist(), 'deciles': deciles.tolist(),
      'last_over_first': float(deciles[-1] / deciles[0]) if deciles[0] else None,
      'segment_lengths': _hist(np.asarray(seg_lens), t),
      'doc_lengths': _hist(doc_lens, t),
      'mean_doc_pairs': float(doc_lens.mean()) if len(doc_lens) else 0.0,
      'decode_errors': _decode_errors(src),
  }


def _decode_errors(src) -> dict[str, Any] | None:
  """Documents of invalid UTF-8 (data.on_decode_error): at the corpus build, and met while
  reading records here (TFDS datasets); None for the synthetic source."""
  if not hasattr(src, 'decode_errors'):
    return None
  out = dict(src.build_decode_errors or {'mode': src.on_decode_error, 'documents': 0,
                                          'files': []})
  out['documents'] += int(src.decode_errors)
  return out


def format_report(rep: dict[str, Any]) -> str:
  """Human-readable text of an `exposure` dict."""
  t = rep['seq_len']
  lines = [f"source={rep['source']}{'/' + rep['name'] if rep['name'] else ''} "
           f"policy={rep['policy']} seq_len={t} batches={rep['num_batches']}x"
           f"{rep['batch_size']}",
           f"real tokens {rep['real_tokens']} of {rep['token_slots']} slots "
           f"(padding {100 * rep['padding_fraction']:.1f}%)",
           'real tokens per position, mean per decile of positions:']
  edges = np.linspace(0, t, 11).astype(int)
  first = rep['deciles'][0] or 1.0
  for i, d in enumerate(rep['deciles']):
    bar = '#' * int(round(40 * d / max(max(rep['deciles']), 1e-9)))
    lines.append(f'  [{edges[i]:5d},{edges[i + 1]:5d})  {d:10.1f}  {d / first:5.2f}x  {bar}')
  bad = rep.get('decode_errors')
  if bad and bad['documents']:
    lines.append(f"invalid UTF-8: {bad['documents']} document(s) "
                 f"({'replaced by U+FFFD' if bad['mode'] == 'replace' else 'dropped'}, "
                 f"data.on_decode_error={bad['mode']}); files: {', '.join(bad['files'][:5])}")
  for key, title in (('doc_lengths', 'source document lengths (pairs, truncated to context)'),
                     ('segment_lengths', 'row segments (pairs)')):
    lines.append(f'{title}:')
    for h in rep[key]:
      lines.append(f"  {h['bucket']:>12s}  docs {h['docs']:7d}  token share "
                   f"{100 * h['token_share']:5.1f}%")
  return '\n'.join(lines)
