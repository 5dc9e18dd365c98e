"""Held-out loss by position bucket, the offset probe, and the evaluation of a workdir.

One jitted function scores a batch and returns per-position sums and per-window bucket
sums; `buckets.BucketAccumulator` keeps them with each window's provenance (document,
start, length, kind), and intervals are clustered by document (docs/DESIGN.md). Batches
are sharded over every device along a 'data' mesh axis (the last batch is padded with
masked rows).

Loss is the float32 cross entropy of `targets[b, t]` from the logits, masked by
`loss_mask`, and is attributed to the input position `positions[b, t]` (the row of the
position table that `inputs[b, t]` used); with the default full-length windows that is
also the number of tokens of context before the target, minus one.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from absl import logging
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from flax_posemb import buckets as buckets_lib
from flax_posemb import defaults
from flax_posemb import data as data_lib
from flax_posemb import model as model_lib
from flax_posemb import embeddings
from flax_posemb import sharding
from flax_posemb import train_step
from flax_posemb import trees
from flax_posemb.batch import BATCH_KEYS
from flax_posemb.data.pipeline import EVAL_POLICIES, PROVENANCE_KEYS
OFFSET_NOTE = (
    'Offset probe: each text is scored with position ids shifted by K while its context '
    'is unchanged. For a model trained with the natural policy, rows p+K seen with only p '
    'tokens of context are off the training distribution (row p+K was trained with p+K '
    'tokens of context); a model trained with random_offset is the control.')

ApplyFn = Callable[[Any, jax.Array, jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass
class EvalOutput:
  """Results of one evaluation.

  Attributes:
    results: the results.json dict (JSON-serializable).
    per_position: {'position', 'loss_sum', 'count', 'loss', ['bayes_loss', 'filter_loss']}, each
      [L]; for the offset probe also 'offset_loss' [num_offsets, L'] and 'offset_count'.
    per_window: `BucketAccumulator.per_window()` of the plain evaluation (windows.npz, with
      the windows' provenance).
  """
  results: dict[str, Any]
  per_position: dict[str, np.ndarray]
  per_window: dict[str, np.ndarray] | None = None


@functools.lru_cache(maxsize=16)
def model_apply_fn(model) -> ApplyFn:
  """(params, inputs [B,T], positions [B,T], segment_ids [B,T]) -> logits [B,T,V] for a TransformerLM."""
  def apply(params, inputs, positions, segment_ids):
    return model.apply({'params': params}, inputs, positions, segment_ids=segment_ids,
                       deterministic=True)
  return apply


def make_eval_step(apply_fn: ApplyFn, edges: np.ndarray, mesh: jax.sharding.Mesh):
  """Cached `_make_eval_step`: periodic evaluations of one model compile once."""
  return _make_eval_step(apply_fn, tuple(int(e) for e in edges), mesh)


@functools.lru_cache(maxsize=32)
def _make_eval_step(apply_fn: ApplyFn, edges: tuple[int, ...], mesh: jax.sharding.Mesh):
  """Jitted (params, batch, offset) -> sums for one batch.

  Args:
    apply_fn: see `model_apply_fn`.
    edges: [nb + 1] bucket edges over positions [0, L).
    mesh: mesh with a 'data' axis; batch arrays are sharded along it, outputs replicated.

  Returns:
    A function of (params, batch dict of [B, T] arrays, offset int32 scalar) returning
    {'loss_sum': [L], 'count': [L], 'win_sum': [B, nb], 'win_count': [B, nb]} (float32).
    The model sees `positions + offset`; sums are indexed by the unshifted `positions`.
  """
  length = int(edges[-1])
  nb = len(edges) - 1
  bucket_of = jnp.asarray(buckets_lib.bucket_of_position(np.asarray(edges)))
  replicated = NamedSharding(mesh, P())

  def step(params, batch, offset):
    logits = apply_fn(params, batch['inputs'], batch['positions'] + offset, batch['segment_ids'])
    mask = batch['loss_mask'].astype(jnp.float32)
    loss = train_step.token_losses(logits, batch['targets'])  # the training loss, float32
    loss = jnp.where(mask > 0, loss, 0.0) * mask
    pos = jnp.clip(batch['positions'], 0, length - 1)
    onehot = jax.nn.one_hot(bucket_of[pos], nb, dtype=jnp.float32)
    return {
        'loss_sum': jnp.zeros(length, jnp.float32).at[pos].add(loss),
        'count': jnp.zeros(length, jnp.float32).at[pos].add(mask),
        'win_sum': jnp.einsum('bt,btk->bk', loss, onehot),
        'win_count': jnp.einsum('bt,btk->bk', mask, onehot),
    }

  return jax.jit(step, out_shardings=replicated)


def _check_batch(batch: dict[str, np.ndarray], length: int, offsets: Sequence[int],
                 max_len: int | None) -> dict[str, np.ndarray]:
  missing = [k for k in BATCH_KEYS if k not in batch]
  if missing:
    raise ValueError(f'evaluation batch lacks keys {missing}; a batch needs {list(BATCH_KEYS)}.')
  out = {k: np.asarray(batch[k]) for k in BATCH_KEYS}
  shape = out['inputs'].shape
  if any(v.shape != shape for v in out.values()) or len(shape) != 2:
    shapes = {k: v.shape for k, v in out.items()}
    raise ValueError(f'batch arrays must all be [B, T]; got {shapes}.')
  scored = out['loss_mask'] > 0
  if scored.any():
    low = int(out['positions'][scored].min())
    if low < 0:  # It would be booked at position 0.
      raise ValueError(f'scored position id {low} is negative; position ids of scored targets '
                       f'must lie in [0, {length}).')
    top = int(out['positions'][scored].max())
    if top >= length:
      raise ValueError(f'position id {top} is outside the evaluated range [0, {length}); '
                       'use a window length / bucket edges that cover it.')
    if max_len is not None and top + max(offsets) >= max_len:
      raise ValueError(f'offset {max(offsets)} pushes position {top} past the position table '
                       f'(max_len={max_len}); the largest valid offset is {max_len - 1 - top}.')
  if max_len is not None:  # Every id the model sees, scored or not, shifted by each offset.
    for k in {min(offsets), max(offsets)}:
      embeddings.check_position_range(out['positions'] + k, max_len)
  return out


def _pad_rows(batch: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
  b = len(next(iter(batch.values())))
  if b == rows:
    return batch
  if b > rows:
    raise ValueError(f'batch of {b} rows is larger than the evaluation batch size {rows}.')
  return {k: np.concatenate([v, np.zeros((rows - b,) + v.shape[1:], v.dtype)]) for k, v in batch.items()}


def accumulate(apply_fn: ApplyFn, params, batches: Iterable[dict[str, np.ndarray]],
               edges: np.ndarray, *, offsets: Sequence[int] = (0,), max_len: int | None = None,
               mesh: jax.sharding.Mesh | None = None) -> list[buckets_lib.BucketAccumulator]:
  """Streams batches through the jitted step, once per offset.

  Args:
    apply_fn: see `model_apply_fn`.
    params: model parameters (replicated over the mesh).
    batches: iterable of batch dicts ([B, T] arrays, see docs/DESIGN.md, and optionally the
      [B] provenance `PROVENANCE_KEYS`), the same global batches on every process (each
      process feeds its own block of rows to its devices).
    edges: [nb + 1] bucket edges; positions must lie in [0, edges[-1]).
    offsets: position-id shifts K; each batch is scored once per K.
    max_len: position-table size; an offset pushing a position past it is an error.
    mesh: device mesh with a 'data' axis (default: all devices).

  Returns:
    One `BucketAccumulator` per offset.
  """
  mesh = mesh or sharding.make_mesh()
  step = make_eval_step(apply_fn, edges, mesh)
  params = jax.device_put(params, NamedSharding(mesh, P()))
  data_sharding = NamedSharding(mesh, P('data'))
  num_devices, num_proc, proc = jax.device_count(), jax.process_count(), jax.process_index()
  accs = [buckets_lib.BucketAccumulator(edges) for _ in offsets]
  rows, seen = None, {}
  for batch in batches:
    prov = {k: np.asarray(batch[k]) for k in PROVENANCE_KEYS if k in batch}
    batch = _check_batch(batch, int(edges[-1]), offsets, max_len)
    if rows is None:  # global rows: a multiple of the device count, fixed for one compile
      rows = -(-batch['inputs'].shape[0] // num_devices) * num_devices
    batch, prov = _pad_rows(batch, rows), _pad_rows(prov, rows) if prov else None
    # Every process reads the same windows; each feeds its own contiguous block of rows.
    per = rows // num_proc
    dev = {k: jax.make_array_from_process_local_data(data_sharding, v[proc * per:(proc + 1) * per],
                                                     v.shape)
           for k, v in batch.items()}
    ids = buckets_lib.unique_window_ids(buckets_lib.window_ids(
        batch['inputs'], batch['positions'], batch['loss_mask']), seen)
    for acc, k in zip(accs, offsets):
      out = jax.device_get(step(params, dev, jnp.int32(k)))
      acc.add(out['loss_sum'], out['count'], out['win_sum'], out['win_count'], ids, prov)
  if rows is None:
    raise ValueError('no evaluation batches: the split produced no windows; '
                     'check the split name and that its documents are long enough.')
  return accs


def summarize(acc: buckets_lib.BucketAccumulator, *, step: int | None = None,
              reference: dict[str, np.ndarray] | None = None) -> EvalOutput:
  """results.json dict and per-position vectors from one accumulator."""
  per_position = acc.per_position()
  length = len(per_position['position'])
  if reference is not None:
    reference = {k: np.asarray(reference[k], np.float64)[:length] for k in ('bayes_loss', 'filter_loss')}
    per_position.update(reference)
  results = {'step': step, 'buckets': acc.buckets(reference), 'overall': acc.overall(),
             'degradation': acc.degradation()}
  return EvalOutput(results, per_position, acc.per_window())


MIN_BUCKET_WINDOWS = 30  # Fewer windows than this make a bucket's interval unreliable.


def thin_buckets(rows: Sequence[dict[str, Any]]) -> list[str]:
  """At most two warnings: buckets with no scored token, and buckets with fewer than
  ``MIN_BUCKET_WINDOWS`` windows (their intervals are unreliable)."""
  spans = lambda bs: ', '.join(f"[{b['start']}, {b['end']})" for b in bs)  # noqa: E731
  empty = [b for b in rows if not b['tokens']]
  thin = [b for b in rows if b['tokens'] and b['windows'] < MIN_BUCKET_WINDOWS]
  out = []
  if empty:
    out.append(f'{len(empty)} bucket(s) have no scored token ({spans(empty)}): no window '
               'reaches them; use longer documents or other bucket edges.')
  if thin:
    out.append(f"{len(thin)} of {len(rows)} bucket(s) have fewer than {MIN_BUCKET_WINDOWS} "
               f"windows (min {min(b['windows'] for b in thin)}): their intervals are "
               'unreliable; evaluate more windows (eval.num_windows: eval.py --num_windows N, '
               'train.py --config.eval.num_windows=N).')
  return out


def eval_settings(config: ml_collections.ConfigDict, overrides: dict[str, Any]) -> dict[str, Any]:
  """The evaluation settings of ``config`` (fields its ``eval`` section lacks, e.g. in a run
  saved by an older version, take ``defaults.evaluation()``), with ``overrides`` (None = keep).

  Returns:
    Dict ``split``, ``policy``, ``num_windows``, ``batch_size``, ``bucket_size``,
    ``bucket_edges``, ``window_len`` (0 resolved to ``model.max_len``), ``seed``,
    ``window_start``, ``min_doc_len`` (0 resolved to 4 * window_len), ``min_start`` (0
    resolved to window_len): the one place these defaults are resolved.
  """
  ev = defaults.evaluation().to_dict()
  ev.update(config.get('eval', ml_collections.ConfigDict()).to_dict())
  s = {'split': config.data.get('eval_split', defaults.data().eval_split),
       'policy': ev['position_policy'], 'window_len': ev['window_len'] or config.model.max_len,
       **{k: ev[k] for k in ('num_windows', 'batch_size', 'bucket_size', 'bucket_edges', 'seed',
                             'window_start', 'min_doc_len', 'min_start')}}
  s.update({k: v for k, v in overrides.items() if v is not None})
  if s['policy'] not in EVAL_POLICIES:
    raise ValueError(f'evaluation position policy must be one of {EVAL_POLICIES}, got '
                     f"{s['policy']!r}.")
  for key in ('min_doc_len', 'min_start'):
    if int(s[key]) < 0:
      raise ValueError(f'eval.{key} must be >= 0 (0 = its default), got {s[key]}.')
  s['min_doc_len'], s['min_start'] = data_lib.pipeline.deep_limits(
      s['window_len'], s['min_doc_len'], s['min_start'])
  return s


def expected_params(model) -> Any:
  """The params tree of ``model`` (ShapeDtypeStructs), without initializing it."""
  x = jnp.zeros((1, 2), jnp.int32)
  return jax.eval_shape(lambda: model.init(jax.random.key(0), x, x))['params']


def make_batches(config: ml_collections.ConfigDict, s: dict[str, Any]
                 ) -> tuple[dict[str, np.ndarray], ...]:
  """`data.make_eval_batches` of the settings ``s`` (`eval_settings`), built once per process
  for the same data config and settings: the startup check and every periodic evaluation of
  a run share one scan of the split (deep windows read every document's length). Callers
  must not modify the arrays."""
  keys = ('split', 'window_len', 'num_windows', 'batch_size', 'policy', 'seed', 'window_start',
          'min_doc_len', 'min_start')
  return _batches(json.dumps(config.data.to_dict(), sort_keys=True, default=str),
                  tuple((k, s[k]) for k in keys))


@functools.lru_cache(maxsize=4)
def _batches(data_json: str, settings: tuple[tuple[str, Any], ...]
             ) -> tuple[dict[str, np.ndarray], ...]:
  s = dict(settings)
  return tuple(data_lib.make_eval_batches(
      ml_collections.ConfigDict(json.loads(data_json)), split=s['split'],
      window_len=int(s['window_len']), num_windows=int(s['num_windows']),
      batch_size=int(s['batch_size']), policy=s['policy'], seed=int(s['seed']),
      window_start=s['window_start'], min_doc_len=s['min_doc_len'], min_start=s['min_start']))


# The settings recorded in results.json.
SETTINGS_KEYS = ('split', 'policy', 'num_windows', 'window_len', 'window_start', 'min_doc_len',
                 'min_start', 'seed')


def check_compatible(model, params, window_len: int) -> None:
  """Raises ValueError if `params` do not fit `model` or the window exceeds its position table."""
  cfg = model.config
  max_len = int(cfg.max_len)
  if window_len > max_len:
    raise ValueError(f'evaluation window of {window_len} tokens exceeds the model context / position '
                     f'table (max_len={max_len}). Fix: evaluate with window_len <= {max_len}.')
  trees.check_same_tree(
      'params', params, expected_params(model), 'checkpoint parameters do not match the model '
      f'config (max_len={max_len}, emb_dim={cfg.emb_dim}, num_layers={cfg.num_layers}, '
      f'vocab_size={cfg.vocab_size})', 'Fix: evaluate with the config saved in the checkpoint.')


def run_evaluation(model, params, config: ml_collections.ConfigDict, *, step: int | None = None,
                   offsets: Sequence[int] | None = None, mesh=None, **overrides) -> EvalOutput:
  """Loss by position bucket of `model` on held-out windows (and the offset probe if `offsets`).

  Args:
    model: a `TransformerLM`.
    params: its parameters (a pytree of arrays).
    config: full run config (sections data, model, eval).
    step: training step recorded in the results.
    offsets: position-id shifts K for the offset probe: the same windows cut to their first
      window_len - max(offsets) tokens, scored once per K with position ids + K, reported by
      context length. The main results are always the plain evaluation at window_len.
    mesh: device mesh with a 'data' axis (default: all devices).
    **overrides: `eval_settings` keys (None = config value).

  Returns:
    `EvalOutput`; with offsets, results['offset_probe'] holds one bucket table per K; with
    window provenance, results also hold `buckets.provenance_tables` ('windows', 'by_kind',
    'by_depth', 'by_end').
  """
  s = eval_settings(config, overrides)
  max_len = int(model.config.max_len)
  check_compatible(model, params, s['window_len'])
  offsets = sorted({int(k) for k in offsets}) if offsets else None
  window = s['window_len']
  if offsets:
    if offsets[0] < 0:
      raise ValueError(f'offsets must be >= 0, got {offsets}.')
    window = s['window_len'] - offsets[-1]
    if window < 1:
      raise ValueError(f"offset {offsets[-1]} leaves no tokens in a window of {s['window_len']}; "
                       f"the largest valid offset is {s['window_len'] - 1}.")
    if window + offsets[-1] > max_len:
      raise ValueError(f'offset {offsets[-1]} pushes positions past the position table '
                       f'(max_len={max_len}); the largest valid offset is {max_len - window}.')
  fn = model_apply_fn(model)

  full_edges = buckets_lib.make_edges(s['window_len'], s['bucket_size'], s['bucket_edges'])
  windows = make_batches(config, s)  # The same windows for both passes.

  def passes(length, ks):
    edges = np.asarray([e for e in full_edges if e < length] + [length])  # probe: clipped
    # The probe reads the first `length` tokens of the very windows of the plain evaluation.
    batches = ({k: v[:, :length] if v.ndim == 2 else v for k, v in b.items()} for b in windows)
    accs = accumulate(fn, params, batches, edges, offsets=ks, max_len=max_len, mesh=mesh)
    reference = data_lib.reference_losses(config.data, length)
    return [summarize(a, step=step, reference=reference) for a in accs]

  out, = passes(s['window_len'], (0,))
  out.results['settings'] = {k: s[k] for k in SETTINGS_KEYS}
  if 'doc' in out.per_window:
    out.results.update(buckets_lib.provenance_tables(out.per_window, s['window_len']))
  out.results['warnings'] = thin_buckets(out.results['buckets'])
  for w in out.results['warnings']:
    logging.warning('%s', w)
  if offsets:
    probes = passes(window, offsets)
    out.results['offset_probe'] = {
        'note': OFFSET_NOTE, 'window_len': window, 'offsets': offsets,
        'by_offset': [dict(offset=k, **p.results) for k, p in zip(offsets, probes)],
        # The same windows at every K: K - K0 per bucket with a paired interval.
        'paired_vs_first': [
            {'offset': k, 'minus_offset': offsets[0], 'buckets': buckets_lib.paired_difference(
                p.per_window, probes[0].per_window, (f'K={k}', f'K={offsets[0]}'))}
            for k, p in zip(offsets[1:], probes[1:])]}
    out.per_position['offsets'] = np.asarray(offsets)
    out.per_position['offset_loss'] = np.stack([p.per_position['loss'] for p in probes])
    out.per_position['offset_count'] = np.stack([p.per_position['count'] for p in probes])
  return out


# Evaluation options that change the results, in the order they appear in a variant's name.
VARIANT_KEYS = ('split', 'policy', 'window_start', 'min_doc_len', 'min_start', 'num_windows',
                'window_len', 'bucket_size', 'bucket_edges', 'seed')


def variant_name(step: int | None, *, offsets: Sequence[int] | None = None,
                 analyze: bool = False, **overrides) -> str:
  """The name of an evaluation's output directory: ``step_N`` plus every option given
  (e.g. ``step_400_window_start-deep_min_start-1024_offsets-0-64``), so variants never share
  a directory.
  """
  parts = [] if step is None else [f'step_{step}']
  for key in VARIANT_KEYS:
    v = overrides.get(key)
    if v is not None and v != '':
      parts.append(f"{key}-{str(v).replace(',', '-').replace(os.sep, '-')}")
  if offsets:
    parts.append('offsets-' + '-'.join(str(k) for k in sorted(set(offsets))))
  if analyze:
    parts.append('analyze')
  return '_'.join(parts)


def evaluate_workdir(workdir: str, *, step: int | None = None, output: str | None = None,
                     offsets: Sequence[int] | None = None, analyze: bool = False,
                     **overrides) -> dict[str, Any]:
  """Restores params + config of a run, evaluates, and writes the outputs.

  Args:
    workdir: training workdir with checkpoints/.
    step: checkpoint step (None = latest).
    output: output directory (default ``WORKDIR/eval/<variant_name>``).
    offsets: offset probe shifts, or None.
    analyze: also run the table analysis (`analysis.analyze_workdir`) into OUTPUT/analysis.
    **overrides: see `run_evaluation`.

  Returns:
    {'results', 'per_position', 'per_window', 'files', 'out_dir', 'step', 'table' (text,
    preceded by the note when the step is not simply the one asked for), 'note',
    'checkpoint'}: 'step' is the step actually evaluated (also results['step']);
    results['checkpoint'] and 'checkpoint' are `checkpointing.RestoreInfo.to_json()` (step,
    requested, fell_back_from, vanished). With step None the newest step at the time is
    evaluated: a step deleted while it is read is replaced by the new newest one, never an
    older one; a damaged newest step is skipped with a warning and named in the note.
  """
  from flax_posemb import checkpointing  # pylint: disable=g-import-not-at-top
  from flax_posemb import eval_report  # pylint: disable=g-import-not-at-top  (matplotlib)
  from flax_posemb import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  mesh = sharding.make_mesh()
  run = workdir_lib.saved_config(workdir)  # the run whose checkpoint this must be
  params, cfg, info = checkpointing.restore_params_with_info(
      workdir, step, sharding=NamedSharding(mesh, P()),
      expected=None if run is None else expected_params(_make_model(run)))
  step, note = info.step, checkpoint_note(info)
  config = ml_collections.ConfigDict(cfg)
  model = _make_model(cfg)
  out = run_evaluation(model, params, config, step=step, offsets=offsets, mesh=mesh, **overrides)
  out.results.update(workdir=os.path.abspath(workdir), step=step, checkpoint=info.to_json())
  out_dir = output or os.path.join(workdir, 'eval', variant_name(
      step, offsets=offsets, analyze=analyze, **overrides))
  d = config.data
  title = (f'{os.path.basename(os.path.normpath(workdir))}: {d.position_policy}, '
           f'{config.model.position_init} init, step {step}')
  files = eval_report.write_outputs(out.results, out.per_position, out_dir, title=title,
                                    per_window=out.per_window)
  text = (note + '\n' if note else '') + eval_report.format_table(out.results)
  if out.results.get('windows'):
    groups = eval_report.format_groups(out.results)
    text += '\n\n' + eval_report.format_windows(out.results['windows'])
    text += '\n\n' + groups if groups else ''
  if out.results.get('offset_probe'):
    text += '\n\n' + eval_report.format_offsets(out.results['offset_probe'])
  if analyze:
    summary = _analyze(workdir, model, params, config, step, out, out_dir, overrides)
    files.update({f'analysis_{k}': v for k, v in summary['files'].items()})
    text += (f"\n\nposition probe R^2 {summary['probe']['r2']:.3f}; table analysis: "
             f"{summary['files']['json']}")
  return {'results': out.results, 'per_position': out.per_position,
          'per_window': out.per_window, 'files': files, 'out_dir': out_dir, 'step': step,
          'table': text, 'note': note, 'checkpoint': info.to_json()}


def _make_model(config: dict[str, Any]):
  """The model of a stored config (its position table comes from the checkpoint: the file
  a ``file:`` init read may be gone)."""
  config = ml_collections.ConfigDict(config)
  if str(config.model.get('position_init', '')).startswith('file:'):
    config.model.position_init = 'zeros'
  if config.model.get('attention_impl') == 'cudnn':
    # cuDNN runs only on some GPUs and even lengths; every implementation computes the same
    # function, so a run trained with it is evaluated with this platform's choice.
    config.model.attention_impl = 'auto'
  return train_step.make_model(config)


def _analyze(workdir, model, params, config, step, out, out_dir, overrides) -> dict[str, Any]:
  """Table analysis of an evaluated run (drift from its step-0 table when one exists)."""
  from flax_posemb import analysis  # pylint: disable=g-import-not-at-top
  from flax_posemb import checkpointing  # pylint: disable=g-import-not-at-top
  if model_lib.POSITION_TABLE_PATH[0] not in params:
    raise ValueError(f'--analyze needs a learned position table; this run uses '
                     f'position_embedding={config.model.position_embedding!r}.')
  table = np.asarray(jax.device_get(model_lib.position_table(params)))
  initial = None
  if not os.path.exists(os.path.join(workdir, 'tables', 'table_0.npy')) and step != 0:
    try:
      initial = np.asarray(model_lib.position_table(checkpointing.restore_params(workdir, 0)[0]))
    except (FileNotFoundError, checkpointing.CheckpointDamagedError) as e:
      logging.warning('No initial table for the drift analysis: %s', e)
  s = eval_settings(config, overrides)
  return analysis.analyze_workdir(
      workdir, table, os.path.join(out_dir, 'analysis'), step=step, initial=initial,
      per_position=out.per_position, bucket_size=s['bucket_size'],
      bucket_edges=s['bucket_edges'])


def evaluate_and_compare(workdirs: Sequence[str], *, output: str | None = None,
                         **kwargs) -> tuple[list[tuple[str, dict[str, Any]]], dict | None]:
  """``evaluate_workdir`` of each run and, for several, their comparison with paired
  differences over the shared windows.

  Args:
    workdirs: training workdirs.
    output: with one run, its output directory; with several, the comparison directory
      (each run's outputs go to ``output/LABEL``). Default: each run's ``eval/<variant>`` and
      ``<parent of the first run>/compare_<A>_vs_<B>[_<variant>]``.
    **kwargs: ``evaluate_workdir`` options (step, offsets, analyze, overrides).

  Returns:
    ``([(label, run), ...], comparison or None)``; a comparison is ``eval_report.compare``'s
    dict plus ``out_dir``.
  """
  from flax_posemb import eval_report  # pylint: disable=g-import-not-at-top
  labels = [os.path.basename(os.path.normpath(w)) for w in workdirs]
  if len(set(labels)) < len(labels):
    labels = [os.path.normpath(w).replace(os.sep, '_') for w in workdirs]
  runs = []
  for workdir, label in zip(workdirs, labels):
    out = os.path.join(output, label) if output and len(workdirs) > 1 else output
    runs.append((label, evaluate_workdir(workdir, output=out, **kwargs)))
  if len(runs) < 2:
    return runs, None
  steps = sorted({r['step'] for _, r in runs})
  variant = variant_name(steps[0] if len(steps) == 1 else None,
                         **{k: v for k, v in kwargs.items() if k != 'step'})
  name = 'compare_' + '_vs_'.join(labels) + (f'_{variant}' if variant else '')
  # Beside the first run, spelled as the user spelled it (like each run's own outputs).
  out_dir = output or os.path.join(os.path.dirname(os.path.normpath(workdirs[0])), name)
  comp = eval_report.compare(labels, [r['results'] for _, r in runs], out_dir,
                             per_window=[r['per_window'] for _, r in runs])
  return runs, dict(comp, out_dir=out_dir)


def checkpoint_note(info) -> str:
  """One line saying which checkpoint was evaluated when it is not simply the one asked
  for ('' otherwise): damaged newer steps skipped, steps deleted while read."""
  parts = []
  if info.fell_back_from:
    parts.append('skipped damaged ' + '; '.join(
        f"step {d['step']} ({d['reason']})" for d in info.fell_back_from))
  if info.vanished:
    parts.append('step(s) ' + ', '.join(str(s) for s in info.vanished)
                 + ' deleted by a running training while being read')
  if not parts:
    return ''
  return f'evaluated checkpoint step {info.step}: ' + '; '.join(parts) + '.'

