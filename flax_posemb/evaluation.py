"""Held-out loss by position bucket and the offset probe: the jitted step,
streaming accumulation, summaries (docs/DESIGN.md, "Evaluation outputs")."""

from collections.abc import Callable, Iterable, Sequence
import dataclasses
import functools
import json
from typing import Any

from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from flax_posemb import buckets as buckets_lib
from flax_posemb import data as data_lib
from flax_posemb import defaults
from flax_posemb import sharding
from flax_posemb import train_step
from flax_posemb import trees
from flax_posemb.data.pipeline import PROVENANCE_KEYS

OFFSET_NOTE = (
    'Offset probe: each text is scored with position ids shifted by K while its'
    ' context is unchanged. For a model trained with the natural policy, rows'
    ' p+K seen with only p tokens of context are off the training distribution'
    ' (row p+K was trained with p+K tokens of context); a model trained with'
    ' random_offset is the control.'
)
SETTINGS_KEYS = (
    'split',
    'policy',
    'num_windows',
    'window_len',
    'window_start',
    'min_doc_len',
    'min_start',
    'seed',
)  # recorded in results.json
# Fewer windows than this make a bucket's interval unreliable.
MIN_BUCKET_WINDOWS = 30


@dataclasses.dataclass
class EvalOutput:
  """results.json dict, per_position.npz and windows.npz of one evaluation
  (docs/DESIGN.md)."""

  results: dict[str, Any]
  per_position: dict[str, np.ndarray]
  per_window: dict[str, np.ndarray] | None = None


@functools.lru_cache(maxsize=16)
def model_apply_fn(model) -> Callable:
  """(params, inputs, positions, segment_ids [B, T]) -> logits [B, T, V] of
  ``model``."""

  def apply(params, inputs, positions, segment_ids):
    return model.apply(
        {'params': params},
        inputs,
        positions,
        segment_ids=segment_ids,
        deterministic=True,
    )

  return apply


@functools.lru_cache(maxsize=32)
def _make_eval_step(
    apply_fn: Callable, edges: tuple[int, ...], mesh: jax.sharding.Mesh
):
  length, nb = edges[-1], len(edges) - 1
  bucket_of = jnp.asarray(buckets_lib.bucket_of_position(np.asarray(edges)))

  def step(params, batch, offset):
    pos, mask = batch['positions'], batch['loss_mask'].astype(jnp.float32)
    logits = apply_fn(
        params, batch['inputs'], pos + offset, batch['segment_ids']
    )
    loss = (
        jnp.where(
            mask > 0, train_step.token_losses(logits, batch['targets']), 0.0
        )
        * mask
    )
    onehot = jax.nn.one_hot(bucket_of[pos], nb, dtype=jnp.float32)
    return {
        'loss_sum': jnp.zeros(length, jnp.float32).at[pos].add(loss),
        'count': jnp.zeros(length, jnp.float32).at[pos].add(mask),
        'win_sum': jnp.einsum('bt,btk->bk', loss, onehot),
        'win_count': jnp.einsum('bt,btk->bk', mask, onehot),
    }

  return jax.jit(step, out_shardings=sharding.replicated(mesh))


def make_eval_step(
    apply_fn: Callable, edges: np.ndarray, mesh: jax.sharding.Mesh
):
  """Jitted, cached (params, batch, offset) -> {'loss_sum', 'count': [L],
  'win_sum', 'win_count': [B, nb]}; the model sees ``positions + offset``, sums
  are by ``positions``."""
  return _make_eval_step(apply_fn, tuple(int(e) for e in edges), mesh)


def accumulate(
    apply_fn: Callable,
    params,
    batches: Iterable[dict[str, np.ndarray]],
    edges: np.ndarray,
    *,
    offsets: Sequence[int] = (0,),
    mesh: jax.sharding.Mesh | None = None,
) -> list[buckets_lib.BucketAccumulator]:
  """One `BucketAccumulator` over ``edges`` per shift K in ``offsets`` of
  ``batches`` (the same global [B, T] batches on every process, optionally with
  [B] `PROVENANCE_KEYS`)."""
  mesh = mesh or sharding.make_mesh()
  step = make_eval_step(apply_fn, edges, mesh)
  params = jax.device_put(params, sharding.replicated(mesh))
  length, seen = int(edges[-1]), {}
  accs = [buckets_lib.BucketAccumulator(edges) for _ in offsets]
  for batch in batches:
    b = len(batch['inputs'])
    # padded with masked rows
    rows = -(-b // jax.device_count()) * jax.device_count()
    batch = {
        k: np.concatenate([v, np.zeros((rows - b,) + v.shape[1:], v.dtype)])
        for k, v in batch.items()
    }
    # each process feeds its own block of rows
    per = rows // jax.process_count()
    mine = slice(jax.process_index() * per, (jax.process_index() + 1) * per)
    dev = sharding.global_batch(
        {k: v[mine] for k, v in batch.items()}, mesh, length
    )
    ids = buckets_lib.unique_window_ids(
        buckets_lib.window_ids(
            batch['inputs'], batch['positions'], batch['loss_mask']
        ),
        seen,
    )
    prov = {k: batch[k] for k in PROVENANCE_KEYS if k in batch} or None
    for acc, k in zip(accs, offsets):
      out = jax.device_get(step(params, dev, jnp.int32(k)))
      acc.add(
          out['loss_sum'],
          out['count'],
          out['win_sum'],
          out['win_count'],
          ids,
          prov,
      )
  return accs


def summarize(
    acc: buckets_lib.BucketAccumulator,
    *,
    step: int | None = None,
    reference: dict[str, np.ndarray] | None = None,
) -> EvalOutput:
  """results.json dict and per-position vectors of one accumulator;
  ``reference``: the synthetic source's `data.reference_losses` of its length L
  (``bayes_loss``, ``filter_loss`` [L])."""
  per_position, per_window = acc.per_position(), acc.per_window()
  per_position.update(reference or {})
  return EvalOutput(
      {
          'step': step,
          'buckets': acc.buckets(reference),
          'overall': buckets_lib.overall(per_window),
          'degradation': buckets_lib.degradation(per_window),
      },
      per_position,
      per_window,
  )


def thin_buckets(rows: Sequence[dict[str, Any]]) -> list[str]:
  """Warnings for buckets with no scored token and with fewer than
  `MIN_BUCKET_WINDOWS`."""
  empty = [f"[{b['start']}, {b['end']})" for b in rows if not b['tokens']]
  thin = [
      b['windows']
      for b in rows
      if b['tokens'] and b['windows'] < MIN_BUCKET_WINDOWS
  ]
  return [
      m
      for ok, m in (
          (
              empty,
              (
                  f'{len(empty)} bucket(s) have no scored token'
                  f" ({', '.join(empty)}): no window reaches them; use longer"
                  ' documents or other bucket edges.'
              ),
          ),
          (
              thin,
              (
                  f'{len(thin)} of {len(rows)} bucket(s) have fewer than'
                  f' {MIN_BUCKET_WINDOWS} windows (min {min(thin, default=0)}):'
                  ' their intervals are unreliable; evaluate more windows'
                  ' (eval.num_windows: eval.py --num_windows N, train.py'
                  ' --config.eval.num_windows=N).'
              ),
          ),
      )
      if ok
  ]


def eval_settings(
    config: ml_collections.ConfigDict, overrides: dict[str, Any]
) -> dict[str, Any]:
  """The ``eval`` section of ``config`` with ``overrides`` (None = keep) and the
  probe's ``offsets``, resolved (0 = default) and checked: the one place."""
  ev = defaults.evaluation().to_dict()
  ev.update(config.get('eval', ml_collections.ConfigDict()).to_dict())
  s = {
      'split': config.data.get('eval_split', defaults.data().eval_split),
      'policy': ev['position_policy'],
      'window_len': ev['window_len'] or config.model.max_len,
      **{
          k: ev[k]
          for k in (
              'num_windows',
              'batch_size',
              'bucket_size',
              'bucket_edges',
              'seed',
              'window_start',
              'min_doc_len',
              'min_start',
          )
      },
  }
  s.update({k: v for k, v in overrides.items() if v is not None})
  s['offsets'] = (
      sorted({int(k) for k in s['offsets']}) if s.get('offsets') else None
  )
  max_len, t, ks = (
      int(config.model.max_len),
      int(s['window_len']),
      s['offsets'] or [0],
  )
  problem = next(
      (
          msg
          for bad, msg in (
              *(
                  (
                      int(s[k]) < 0,
                      f'eval.{k} must be >= 0 (0 = its default), got {s[k]}.',
                  )
                  for k in ('min_doc_len', 'min_start')
              ),
              (
                  not 1 <= t <= max_len,
                  (
                      f'evaluation window of {t} tokens exceeds the model'
                      f' context / position table (max_len={max_len}). Fix:'
                      f' evaluate with 1 <= window_len <= {max_len} (0 ='
                      ' max_len).'
                  ),
              ),
              (
                  not 0 <= ks[0] <= ks[-1] < t,
                  (
                      f'offsets {ks} must lie in [0, {t}): the probe scores '
                      'the first window_len - K tokens; the largest valid '
                      f'offset is {t - 1}.'
                  ),
              ),
          )
          if bad
      ),
      None,
  )
  if problem:
    raise ValueError(problem)
  if s['policy'] not in data_lib.pipeline.EVAL_POLICIES:
    raise ValueError(
        f"Unknown evaluation position_policy {s['policy']!r}; use one of"
        f' {data_lib.pipeline.EVAL_POLICIES}.'
    )
  data_lib.pipeline.check_window_start(s['window_start'])
  if int(s['seed']) < 0:
    raise ValueError(f"eval.seed must be >= 0, got {s['seed']}.")
  data_lib.pipeline.check_split(config.data, s['split'])
  s['min_doc_len'], s['min_start'] = data_lib.pipeline.deep_limits(
      t, s['min_doc_len'], s['min_start']
  )
  return s


def make_batches(
    config: ml_collections.ConfigDict, s: dict[str, Any]
) -> tuple[dict[str, np.ndarray], ...]:
  """`data.make_eval_batches` of the settings ``s``, built once per process
  (read-only)."""
  return _batches(
      json.dumps(config.data.to_dict(), sort_keys=True, default=str),
      **{k: s[k] for k in SETTINGS_KEYS + ('batch_size',)},
  )


# keyed by the data config's JSON and the settings
@functools.lru_cache(maxsize=4)
def _batches(data_json: str, **s) -> tuple[dict[str, np.ndarray], ...]:
  ints = {
      k: int(s.pop(k))
      for k in ('window_len', 'num_windows', 'batch_size', 'seed')
  }
  return tuple(
      data_lib.make_eval_batches(
          ml_collections.ConfigDict(json.loads(data_json)), **ints, **s
      )
  )


def expected_params(model) -> Any:
  """The params tree of ``model`` (ShapeDtypeStructs), without initializing
  it."""
  x = jnp.zeros((1, 2), jnp.int32)
  return jax.eval_shape(lambda: model.init(jax.random.key(0), x, x))['params']


def run_evaluation(
    model,
    params,
    config: ml_collections.ConfigDict,
    *,
    step: int | None = None,
    offsets: Sequence[int] | None = None,
    mesh=None,
    **overrides,
) -> EvalOutput:
  """Loss by position bucket of ``model`` on held-out windows, recording
  ``step``, with the offset probe's shifts K ``offsets``; ``overrides``:
  `eval_settings` keys (None = config)."""
  s, cfg = eval_settings(config, dict(overrides, offsets=offsets)), model.config
  # a TreeMismatchError (ValueError) naming the first differing path
  trees.check_same_tree(
      'params',
      params,
      expected_params(model),
      'checkpoint parameters do not match the model config'
      f' (max_len={cfg.max_len}, emb_dim={cfg.emb_dim},'
      f' num_layers={cfg.num_layers}, vocab_size={cfg.vocab_size})',
      'Fix: evaluate with the config saved in the checkpoint.',
  )
  fn, offsets = model_apply_fn(model), s['offsets']
  full_edges = buckets_lib.make_edges(
      s['window_len'], s['bucket_size'], s['bucket_edges']
  )
  windows = make_batches(config, s)  # The same windows for both passes.

  def passes(length, ks):
    # probe: clipped
    edges = np.asarray([e for e in full_edges if e < length] + [length])
    batches = (
        {k: v[:, :length] if v.ndim == 2 else v for k, v in b.items()}
        for b in windows
    )
    accs = accumulate(fn, params, batches, edges, offsets=ks, mesh=mesh)
    reference = data_lib.reference_losses(config.data, length)
    return [summarize(a, step=step, reference=reference) for a in accs]

  (out,) = passes(s['window_len'], (0,))
  out.results['settings'] = {k: s[k] for k in SETTINGS_KEYS}
  if 'doc' in out.per_window:
    out.results.update(
        buckets_lib.provenance_tables(out.per_window, s['window_len'])
    )
  out.results['warnings'] = thin_buckets(out.results['buckets'])
  for w in out.results['warnings']:
    logging.warning('%s', w)
  if offsets:  # K - K0 per bucket, paired over the same windows
    window = s['window_len'] - offsets[-1]
    probes = passes(window, offsets)
    out.results['offset_probe'] = {
        'note': OFFSET_NOTE,
        'window_len': window,
        'offsets': offsets,
        'by_offset': [
            dict(offset=k, **p.results) for k, p in zip(offsets, probes)
        ],
        'paired_vs_first': [
            {
                'offset': k,
                'minus_offset': offsets[0],
                'buckets': buckets_lib.paired_difference(
                    p.per_window,
                    probes[0].per_window,
                    (f'K={k}', f'K={offsets[0]}'),
                ),
            }
            for k, p in zip(offsets[1:], probes[1:])
        ],
    }
    out.per_position.update(
        offsets=np.asarray(offsets),
        offset_loss=np.stack([p.per_position['loss'] for p in probes]),
        offset_count=np.stack([p.per_position['count'] for p in probes]),
    )
  return out
