"""Position-exposure report, ``python -m flax_posemb.data`` (docs/DESIGN.md
§ Data policies and tokens)."""

from typing import Any

import numpy as np

from flax_posemb import buckets as buckets_lib
from flax_posemb import segments
from flax_posemb.data import config as config_lib
from flax_posemb.data import corpus as corpus_lib
from flax_posemb.data import long_text
from flax_posemb.data import pipeline
from flax_posemb.data import policies
from flax_posemb.data import rows as rows_lib
from flax_posemb.data import sources
from flax_posemb.data import windows
from flax_posemb.data.policies import exposure as exposure_lib


def _hist(
    lengths: np.ndarray, seq_len: int, beyond: bool = False
) -> list[dict[str, Any]]:
  """Documents and token share per bucket (0, T/32], ..., (T/2, T] (+ past T) of
  lengths ``[n]``."""
  t = seq_len
  total = max(int(lengths.sum()), 1)
  edges = [0] + [max(1, int(round(t / 2 ** (5 - i)))) for i in range(6)]
  buckets: list[tuple[int, float]] = [
      (lo, hi) for lo, hi in zip(edges[:-1], edges[1:]) if hi > lo
  ]
  if beyond:
    buckets += [(t, 2 * t), (2 * t, 4 * t), (4 * t, 16 * t), (16 * t, np.inf)]
  rows = []
  for lo, hi in buckets:
    if hi == np.inf:
      label = f'({lo},inf)'
    else:
      label = f'({lo},{hi}]'
    selected = (lengths > lo) & (lengths <= hi)
    rows.append(
        {
            'bucket': label,
            'docs': int(selected.sum()),
            'token_share': float(lengths[selected].sum() / total),
        }
    )
  return rows


def policy_shares(
    doc_pairs: np.ndarray, data: config_lib.DataConfig, seed: int = 0
) -> dict[str, policies.Exposure]:
  """Every registered policy's analytic exposure of one epoch.

  Args:
    doc_pairs: ``[n]`` untruncated document lengths (pairs) of a sample.
    data: the data section; each policy reads its own fields of it.
    seed: the report's seed (for policies that draw lengths).

  Returns:
    {policy name: {'token_share', 'last_over_first',
    'full_context_last_over_first'}} (``max_len = seq_len``; docs/DESIGN.md
    § Data policies and tokens), data.position_policy's as ``data`` wraps it
    (data.offset_twin, data.shared_stream).
  """
  corpus = policies.CorpusLengths.of(
      doc_pairs, data.seq_len, data.min_doc_len, seed
  )
  shares = {}
  for name in policies.names():
    policy = policies.get(name)
    if name == data.position_policy:
      # The configured policy as the run uses it (twinned, shared stream).
      policy = data.policy
    shares[name] = policy.exposure(data, corpus)
  return shares


def length_stats(doc_pairs: np.ndarray, seq_len: int) -> dict[str, Any]:
  """Untruncated document lengths (pairs): count, mean, quantiles, share beyond
  the context."""
  n = np.asarray(doc_pairs, np.int64)
  if not len(n):
    return {'docs': 0}

  def quantile(q):
    return float(np.quantile(n, q))

  return {
      'docs': int(len(n)),
      'pairs': int(n.sum()),
      'mean': float(n.mean()),
      'median': quantile(0.5),
      'p90': quantile(0.9),
      'p99': quantile(0.99),
      'max': int(n.max()),
      'docs_longer_than_context': float((n > seq_len).mean()),
      'pairs_past_context': float(
          np.maximum(n - seq_len, 0).sum() / max(n.sum(), 1)
      ),
  }


def exposure(
    config: Any, num_batches: int = 100, num_source_docs: int = 2000
) -> dict[str, Any]:
  """The exposure report of a run's training data.

  Args:
    config: the run's `flax_posemb.config.RunConfig` (its data section, batch
      size, seed, steps, model.max_len and eval section).
    num_batches: training batches measured.
    num_source_docs: source documents sampled for the lengths and the
      analytic models (0 = all).

  Returns:
    A JSON-serializable dict: 'counts' ``[P]`` real tokens per position (P:
    the positions the policy uses), 'deciles' ``[10]``, the analytic
    'policies' table, 'batch_diversity', the kind mixes, ...
  """
  c = config.data
  t = c.seq_len
  max_len = config.model.max_len
  it = pipeline.make_train_iterator(
      c,
      batch_size=config.batch_size,
      seed=config.seed,
      num_train_steps=config.num_train_steps,
      max_len=max_len,
      with_doc_ids=True,
  )
  counts = np.zeros(c.policy.position_count(c, max_len), np.int64)
  # Real tokens whose context is their position (the evaluation's
  # situation), per position.
  full_context_counts = np.zeros_like(counts)
  # Sum of the real tokens' contexts, per position.
  context_sums = np.zeros_like(counts)
  slots = 0
  seg_lens: list[int] = []
  # Per row, its main document: the one with the most tokens (-1: none).
  main_doc_list: list[int] = []
  # Per batch, the document of every real token.
  batch_docs: list[np.ndarray] = []
  for _ in range(num_batches):
    batch = next(it)
    real = batch['segment_ids'] > 0
    batch_docs.append(batch['doc_ids'][real])
    np.add.at(counts, batch['positions'][real], 1)
    contexts = np.asarray(segments.context_lengths(batch['segment_ids']))
    full = real & (contexts == batch['positions'])
    np.add.at(full_context_counts, batch['positions'][full], 1)
    np.add.at(context_sums, batch['positions'][real], contexts[real])
    slots += real.size
    for seg, doc in zip(batch['segment_ids'], batch['doc_ids']):
      seg_lens += np.unique(seg[seg > 0], return_counts=True)[1].tolist()
      ids, tokens = np.unique(doc[doc >= 0], return_counts=True)
      if len(ids):
        main_doc_list.append(int(ids[np.argmax(tokens)]))
      else:
        main_doc_list.append(-1)
  main_docs = np.array(main_doc_list, np.int64).reshape(num_batches, -1)
  deciles, last_over_first = exposure_lib.deciles(counts)
  src = corpus_lib.make_source(c, c.train_split)
  kind_mix = _kind_mix(batch_docs, src)
  if num_source_docs <= 0:
    sampled = len(src)
  else:
    sampled = min(num_source_docs, len(src))
  order = rows_lib.DocOrder(len(src), config.seed, True)
  sample = order.take(np.arange(sampled)).tolist()
  doc_lens = np.array(
      [max(len(src.doc(d, max_pairs=None)) - 1, 0) for d in sample], np.int64
  )
  shares = policy_shares(doc_lens, c, config.seed)
  # Synthetic text; real text: invalid UTF-8 found by the build and while
  # reading.
  bad = None
  if isinstance(src, sources.TextSource):
    if src.build_decode_errors:
      bad = dict(src.build_decode_errors)
    else:
      bad = {'mode': src.on_decode_error, 'documents': 0, 'files': []}
    bad['documents'] += int(src.decode_errors)
  return {
      'source': c.source,
      'name': c.name,
      'policy': c.position_policy,
      'seq_len': t,
      'batch_size': config.batch_size,
      'num_batches': num_batches,
      'real_tokens': int(counts.sum()),
      'token_slots': int(slots),
      'padding_fraction': float(1 - counts.sum() / max(slots, 1)),
      'counts': counts.tolist(),
      'deciles': deciles.tolist(),
      'last_over_first': last_over_first,
      **by_row_and_context(
          counts, full_context_counts, context_sums, config, num_batches
      ),
      'segment_lengths': _hist(np.asarray(seg_lens), t),
      'doc_lengths': _hist(doc_lens, t, True),
      'doc_length_stats': length_stats(doc_lens, t),
      'mean_doc_pairs': float(doc_lens.mean()) if len(doc_lens) else 0.0,
      'policies': shares,
      'token_share': shares[c.position_policy]['token_share'],
      'batch_diversity': batch_diversity(main_docs, doc_lens, c, len(src)),
      'decode_errors': bad,
      'composition': composition(c) if c.source == 'long_text' else None,
      'kind_mix': kind_mix,
      **_eval_mix_or_problem(config),
  }


def by_row_and_context(
    counts: np.ndarray,
    full_context_counts: np.ndarray,
    context_sums: np.ndarray,
    config: Any,
    num_batches: int,
) -> dict[str, Any]:
  """Exposure in two dimensions: per row all occurrences and those at
  context = position (the evaluation's situation), by the evaluation's
  position buckets, and whether the last bucket is rare on each.

  Args:
    counts: ``[P]`` real tokens per position over the report's batches.
    full_context_counts: ``[P]`` those whose context is their position.
    context_sums: ``[P]`` the sum of their contexts.
    config: the run's `RunConfig` (its eval buckets and num_train_steps).
    num_batches: the report's batches.

  Returns:
    'full_context_counts' ``[P]``, 'full_context_deciles' ``[10]``,
    'full_context_last_over_first', 'run_scale' (the run's steps per
    report batch) and 'buckets': per evaluation bucket the mean occurrences
    per row over the report's batches and over the run, all and at full
    context, and the tokens' mean context (None: no tokens);
    'rare_regime': {'all', 'full_context'}, the last bucket's rows against
    the first's (`exposure.rare_regime`) over the run.
  """
  window_len = config.eval.window_len or config.model.max_len
  edges = buckets_lib.make_edges(
      window_len, config.eval.bucket_size, config.eval.bucket_edges
  )
  run_scale = config.num_train_steps / num_batches
  per_row: dict[str, np.ndarray] = {}
  for name, per_position in (
      ('all', counts),
      ('full_context', full_context_counts),
      ('context_sum', context_sums),
  ):
    # Rows of the evaluation window the policy never uses are never trained.
    padded = np.zeros(window_len)
    used = min(window_len, len(per_position))
    padded[:used] = per_position[:used]
    per_row[name] = np.array(
        [padded[a:b].mean() for a, b in zip(edges[:-1], edges[1:])]
    )
  rows = [
      {
          'bucket': f'[{a},{b})',
          'occurrences': float(per_row['all'][i]),
          'full_context_occurrences': float(per_row['full_context'][i]),
          'run_occurrences': float(run_scale * per_row['all'][i]),
          'run_full_context_occurrences': float(
              run_scale * per_row['full_context'][i]
          ),
          'mean_context': _ratio(per_row['context_sum'][i], per_row['all'][i]),
      }
      for i, (a, b) in enumerate(zip(edges[:-1], edges[1:]))
  ]
  deciles, last_over_first = exposure_lib.deciles(full_context_counts)
  return {
      'full_context_counts': full_context_counts.tolist(),
      'full_context_deciles': deciles.tolist(),
      'full_context_last_over_first': last_over_first,
      'run_scale': run_scale,
      'buckets': rows,
      'rare_regime': {
          name: bool(
              exposure_lib.rare_regime(
                  run_scale * values[-1], run_scale * values[0]
              )
          )
          for name, values in per_row.items()
          if name != 'context_sum'
      },
  }


def _ratio(numerator: float, denominator: float) -> float | None:
  """``numerator / denominator`` (None when the denominator is 0)."""
  if not denominator:
    return None
  return float(numerator / denominator)


def _eval_mix_or_problem(config) -> dict:
  """The evaluation windows' kind mix, or why `config` forms no windows.

  A report on the training data stays useful for a corpus too small (or
  without the split) for `config.eval`'s windows; the refusal is kept, word
  for word, so the report says why the mix is missing.
  """
  try:
    return {
        'eval_kind_mix': eval_kind_mix(config),
        'eval_windows_problem': None,
    }
  except ValueError as refusal:
    return {'eval_kind_mix': None, 'eval_windows_problem': str(refusal)}


def eval_kind_mix(config) -> dict[str, float]:
  """Share of the evaluation windows' scored tokens per document kind, for
  the windows `config.eval` selects (docs/DESIGN.md § Evaluation outputs)."""
  ev = config.eval
  window_len = ev.window_len or config.model.max_len
  min_doc_len, min_start = windows.deep_limits(
      window_len, ev.min_doc_len, ev.min_start
  )
  batches = corpus_lib.make_eval_batches(
      config.data,
      split=config.data.eval_split,
      window_len=window_len,
      num_windows=ev.num_windows,
      batch_size=ev.batch_size,
      policy=ev.position_policy,
      seed=ev.seed,
      window_start=ev.window_start,
      min_doc_len=min_doc_len,
      min_start=min_start,
  )
  per_kind: dict[str, float] = {}
  for batch in batches:
    scored = batch['loss_mask'].sum(1)
    for kind, count in zip(batch['kind'].tolist(), scored.tolist()):
      if count:
        per_kind[kind] = per_kind.get(kind, 0.0) + count
  total = max(sum(per_kind.values()), 1.0)
  return {k: per_kind[k] / total for k in sorted(per_kind)}


def _kind_mix(batch_docs: list[np.ndarray], src) -> dict[str, float]:
  """Share of the batches' real tokens per document kind (`DocSource.kind`)."""
  docs, counts = np.unique(np.concatenate(batch_docs), return_counts=True)
  per_kind: dict[str, int] = {}
  for doc, count in zip(docs.tolist(), counts.tolist()):
    kind = src.kind(doc)
    per_kind[kind] = per_kind.get(kind, 0) + count
  total = max(sum(per_kind.values()), 1)
  return {k: per_kind[k] / total for k in sorted(per_kind)}


def batch_diversity(
    main_docs: np.ndarray,
    doc_pairs: np.ndarray,
    data: config_lib.DataConfig,
    split_docs: int,
) -> dict[str, float | None]:
  """How often a batch's rows share a document, measured and for rows drawn
  at random from the policy's epoch (the row order of docs/DESIGN.md § Data
  policies and tokens).

  Args:
    main_docs: ``[num_batches, b]`` each row's main document (-1: none).
    doc_pairs: ``[k]`` untruncated pairs of documents sampled of the split.
    data: the data section (its policy says how many rows a document fills).
    split_docs: documents in the split.

  Returns:
    Shares of same-document row pairs and of one-document batches
    (``random_*``: the random draw's); None when batches hold one row.
  """
  b = main_docs.shape[1]  # rows per batch
  if b < 2:
    return {
        'same_doc_pairs': None,
        'random_same_doc_pairs': None,
        'all_one_doc': None,
        'random_all_one_doc': None,
    }
  i, j = np.triu_indices(b, 1)
  same = (main_docs[:, i] == main_docs[:, j]) & (main_docs[:, i] >= 0)
  one = (main_docs == main_docs[:, :1]).all(1) & (main_docs[:, 0] >= 0)
  pairs = np.asarray(doc_pairs, np.float64)
  # How many rows of an epoch each document fills.
  rows = data.policy.rows_per_document(data, pairs)
  rows = np.where(pairs + 1 >= data.min_doc_len, rows, 0.0)
  p = rows / max(rows.sum(), 1.0)
  sampled_share = len(pairs) / max(split_docs, 1)
  return {
      'same_doc_pairs': float(same.mean()),
      'random_same_doc_pairs': float(sampled_share * np.sum(p**2)),
      'all_one_doc': float(one.mean()),
      'random_all_one_doc': float(sampled_share ** (b - 1) * np.sum(p**b)),
  }


def composition(data_config: config_lib.DataConfig) -> list[dict[str, Any]]:
  """`long_text.split_stats` per split and kind of a `long_text` corpus at
  data.seq_len."""
  rows = []
  for split in ('train', 'validation'):
    src = corpus_lib.make_source(data_config, split)
    lengths: dict[str, list[int]] = {}
    for i in range(len(src)):
      lengths.setdefault(src.kind(i), []).append(
          len(src.doc(i, max_pairs=None))
      )
    rows += [
        {
            'split': split,
            'kind': k,
            **long_text.split_stats(lengths[k], data_config.seq_len),
        }
        for k in sorted(lengths, key=long_text.KINDS.index)
    ]
  return rows


def format_report(rep: dict[str, Any]) -> str:
  """Human-readable text of an `exposure` dict."""
  t = rep['seq_len']
  lines = [
      (
          f"source={rep['source']}{'/' + rep['name'] if rep['name'] else ''}"
          f" policy={rep['policy']} seq_len={t}"
          f" batches={rep['num_batches']}x{rep['batch_size']}"
      ),
      (
          f"real tokens {rep['real_tokens']} of {rep['token_slots']} slots "
          f"(padding {100 * rep['padding_fraction']:.1f}%)"
      ),
      (
          'measured late/early exposure (last/first decile):'
          f" {_fmt(rep['last_over_first'])}"
      ),
      'real tokens per position, mean per decile of positions:',
  ]
  edges = np.linspace(0, t, 11).astype(int)
  first = rep['deciles'][0] or 1.0
  top = max(max(rep['deciles']), 1e-9)
  lines += [
      f'  [{a:5d},{b:5d})  {d:10.1f}  {d / first:5.2f}x '
      f' {"#" * int(round(40 * d / top))}'
      for a, b, d in zip(edges[:-1], edges[1:], rep['deciles'])
  ]
  lines += _bucket_lines(rep)
  for key, what in (
      ('kind_mix', 'training tokens'),
      ('eval_kind_mix', 'evaluation windows (scored tokens)'),
  ):
    mix = rep.get(key)
    if mix:
      lines.append(
          f'{what} by document kind: '
          + ', '.join(f'{k} {100 * v:.1f}%' for k, v in mix.items())
      )
  if rep.get('eval_windows_problem'):
    lines.append(f"evaluation windows: none ({rep['eval_windows_problem']})")
  div = rep.get('batch_diversity')
  if div and div['same_doc_pairs'] is not None:
    lines.append(
        'rows of one batch from one document:'
        f" {100 * div['same_doc_pairs']:.2f}% of row pairs (random draw"
        f" {100 * div['random_same_doc_pairs']:.2f}%),"
        f" {100 * div['all_one_doc']:.2f}% of batches all one document (random"
        f" draw {100 * div['random_all_one_doc']:.4f}%)"
    )
  bad = rep.get('decode_errors')
  if bad and bad['documents']:
    lines.append(
        f"invalid UTF-8: {bad['documents']} document(s)"
        f" ({'replaced by U+FFFD' if bad['mode'] == 'replace' else 'dropped'},"
        f" data.on_decode_error={bad['mode']}); files:"
        f" {', '.join(bad['files'][:5])}"
    )
  st = rep.get('doc_length_stats', {})
  if st.get('docs'):
    lines.append(
        f"source documents (sample of {st['docs']}, untruncated, pairs): mean"
        f" {st['mean']:.0f}, median {st['median']:.0f}, p90 {st['p90']:.0f},"
        f" p99 {st['p99']:.0f}, max {st['max']};"
        f" {100 * st['docs_longer_than_context']:.1f}% of documents are longer"
        f" than the context; {100 * st['pairs_past_context']:.1f}% of all pairs"
        ' lie past the first context of their document'
    )
  for key, title in (
      ('doc_lengths', 'source document lengths (pairs, untruncated)'),
      ('segment_lengths', 'row segments (pairs)'),
  ):
    lines.append(f'{title}:')
    lines += [
        f"  {h['bucket']:>14s}  docs {h['docs']:7d}  token share "
        f"{100 * h['token_share']:5.1f}%"
        for h in rep[key]
    ]
  if rep.get('composition'):
    lines += [
        (
            'corpus by split and kind (tokens with separators; >=4T, >=8T:'
            ' documents of at least 4 and 8 contexts; deep windows: what'
            f' eval.window_start=deep can draw, {t + 1} tokens past the first'
            f' {t} of a document of >= 4 contexts):'
        ),
        '  split      kind          docs     tokens  >=4T  >=8T deep windows',
    ]
    lines += [
        f"  {r['split']:10s} {r['kind']:11s} {r['docs']:6d} {r['tokens']:10d} "
        f"{r['docs_ge_4t']:5d} {r['docs_ge_8t']:5d} {r['deep_windows']:12d}"
        for r in rep['composition']
    ]
  lines.append(
      'per policy (analytic, one epoch of the sample): share of corpus tokens'
      ' used, late/early exposure of all occurrences and of those at context'
      ' = position (n/a: measured only)'
  )
  lines += [
      f"  {'*' if name == rep['policy'] else ' '} {name:16s} tokens used "
      f"{100 * v['token_share']:6.2f}%  late/early {_fmt(v['last_over_first'])}"
      f"  full context {_fmt(v['full_context_last_over_first'])}"
      for name, v in rep['policies'].items()
  ]
  return '\n'.join(lines)


def _bucket_lines(rep: dict[str, Any]) -> list[str]:
  """The two-dimensional exposure by evaluation bucket and its rare
  regime."""
  lines = [
      (
          'measured late/early exposure at context = position (the'
          " evaluation's situation):"
          f" {_fmt(rep['full_context_last_over_first'])}"
      ),
      (
          'occurrences per row by evaluation bucket, over the'
          f" {rep['num_batches']} report batches and over the run"
          f" (x{rep['run_scale']:g}, num_train_steps): all | at context ="
          ' position | mean context'
      ),
  ]
  lines += [
      f"  {b['bucket']:>12s}  {b['occurrences']:10.1f}"
      f" {b['run_occurrences']:12.1f} | {b['full_context_occurrences']:10.1f}"
      f" {b['run_full_context_occurrences']:12.1f} |"
      f" {_fmt(b['mean_context'], 1)}"
      for b in rep['buckets']
  ]
  rare = rep['rare_regime']
  lines.append(
      "rare regime over the run (the last bucket's rows seen fewer than"
      f' {exposure_lib.RARE_OCCURRENCES:g} times each and under a tenth as'
      " often as the first bucket's): all occurrences"
      f" {'yes' if rare['all'] else 'no'}, at context = position"
      f" {'yes' if rare['full_context'] else 'no'}"
  )
  return lines


def _fmt(x, digits: int = 3) -> str:
  return 'n/a' if x is None else f'{x:.{digits}f}'
