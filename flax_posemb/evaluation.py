"""Held-out loss by position bucket and the offset probe: the jitted step,
streaming accumulation, summaries (docs/DESIGN.md § Evaluation outputs)."""

from collections.abc import Callable, Iterable, Sequence
import dataclasses
import functools
from typing import Any

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from flax_posemb import buckets as buckets_lib
from flax_posemb import config as config_lib
from flax_posemb import data as data_lib
from flax_posemb import inference
from flax_posemb import sharding
from flax_posemb import train_step
from flax_posemb.data.windows import PROVENANCE_KEYS

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
  """The files of one evaluation, in memory.

  Their layout: docs/DESIGN.md § Evaluation outputs.

  Args:
    results: the results.json dict: `step`, `buckets` (one row per
      position bucket), `overall`, `degradation`; from `run_evaluation` also
      `settings`, `warnings` and, with offsets, `offset_probe`.
    per_position: per_position.npz: `position`, `loss_sum`, `count`, `loss`
      (NaN where unscored), each `[L]`; the synthetic source adds its
      reference losses `[L]`, and the offset probe `offsets` `[K]`,
      `offset_loss` and `offset_count` `[K, L - max K]`.
    per_window: windows.npz: `window_id` uint64 `[W]`, `win_sum` and
      `win_count` `[W, num_buckets]`, and the data's provenance `[W]`.
    probe_windows: with the offset probe, `{K: per_window of the pass at
      shift K}`; else None.
  """

  results: dict[str, Any]
  per_position: dict[str, np.ndarray]
  per_window: dict[str, np.ndarray]
  probe_windows: dict[int, dict[str, np.ndarray]] | None = None


@functools.lru_cache(maxsize=16)
def model_apply_fn(model) -> Callable:
  """The evaluation forward pass of a linen model, cached per model.

  Args:
    model: a linen `model.TransformerLM` (the cache key).

  Returns:
    A function `apply(params, inputs, positions, segment_ids) -> logits`,
    int32 `[B, T]` inputs, positions and segment ids to float32
    `[B, T, vocab_size]` logits, without dropout.
  """

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
  length = edges[-1]
  num_buckets = len(edges) - 1
  bucket_of = jnp.asarray(buckets_lib.bucket_of_position(np.asarray(edges)))

  def step(params, batch, offset):
    pos = batch['positions']
    mask = batch['loss_mask'].astype(jnp.float32)
    logits = apply_fn(
        params, batch['inputs'], pos + offset, batch['segment_ids']
    )
    token_losses = train_step.token_losses(logits, batch['targets'])
    loss = jnp.where(mask > 0, token_losses, 0.0) * mask
    onehot = jax.nn.one_hot(bucket_of[pos], num_buckets, dtype=jnp.float32)
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
  """The jitted evaluation step, cached per apply function, edges and mesh.

  Args:
    apply_fn: `(params, inputs, positions, segment_ids) -> logits`
      (`model_apply_fn`).
    edges: int bucket edges `[num_buckets + 1]` from 0 to the window length
      L (`buckets.make_edges`).
    mesh: the device mesh the batch is sharded over.

  Returns:
    A function `step(params, batch, offset) -> sums`. `batch` holds `[B, T]`
    `inputs`, `targets`, `positions`, `segment_ids` and `loss_mask`; the
    model sees `positions + offset` while the sums are indexed by
    `positions`. `sums`, replicated, holds float32 `loss_sum` and `count`
    `[L]`, `win_sum` and `win_count` `[B, num_buckets]`.
  """
  return _make_eval_step(apply_fn, tuple(int(e) for e in edges), mesh)


def accumulate(
    apply_fn: Callable,
    params,
    batches: Iterable[dict[str, np.ndarray]],
    edges: np.ndarray,
    *,
    offsets: Sequence[int] = (0,),
    mesh: jax.sharding.Mesh | None = None,
    progress: str = '',
) -> list[buckets_lib.BucketAccumulator]:
  """Scores batches and sums the losses by position and bucket.

  Args:
    apply_fn: `(params, inputs, positions, segment_ids) -> logits`
      (`model_apply_fn`).
    params: the model's parameter tree.
    batches: the same global batches on every process: `[B, T]` `inputs`,
      `targets`, `positions`, `segment_ids`, `loss_mask`, optionally `[B]`
      `PROVENANCE_KEYS`; rows are padded to a multiple of the devices.
    edges: int bucket edges `[num_buckets + 1]` from 0 to T.
    offsets: the shifts K the model sees positions by (0: none); every batch
      is scored once per shift.
    mesh: the device mesh; None makes one over all devices.
    progress: the name of a tqdm bar over the batches on stderr; '' shows
      none.

  Returns:
    One `buckets.BucketAccumulator` per shift in `offsets`, in order.
  """
  mesh = mesh or sharding.make_mesh()
  step = make_eval_step(apply_fn, edges, mesh)
  params = jax.device_put(params, sharding.replicated(mesh))
  length = int(edges[-1])
  # Occurrences of each window id so far (`unique_window_ids`).
  seen: dict[int, int] = {}
  accs = [buckets_lib.BucketAccumulator(edges) for _ in offsets]
  bar = tqdm.tqdm(
      batches,
      desc=progress,
      unit='batch',
      dynamic_ncols=True,
      disable=not progress or jax.process_index() > 0,
  )
  for batch in bar:
    real_rows = len(batch['inputs'])
    # Padded with masked rows to a multiple of the devices.
    rows = -(-real_rows // jax.device_count()) * jax.device_count()
    padded = {
        k: np.concatenate(
            [v, np.zeros((rows - real_rows,) + v.shape[1:], v.dtype)]
        )
        for k, v in batch.items()
    }
    # Each process feeds its own block of rows.
    per_process = rows // jax.process_count()
    first = jax.process_index() * per_process
    mine = slice(first, first + per_process)
    on_devices = sharding.global_batch(
        {k: v[mine] for k, v in padded.items()}, mesh, length
    )
    hashes = buckets_lib.window_ids(
        padded['inputs'], padded['positions'], padded['loss_mask']
    )
    ids = buckets_lib.unique_window_ids(hashes, seen)
    provenance = {k: padded[k] for k in PROVENANCE_KEYS if k in padded}
    for acc, offset in zip(accs, offsets):
      out = jax.device_get(step(params, on_devices, jnp.int32(offset)))
      acc.add(
          out['loss_sum'],
          out['count'],
          out['win_sum'],
          out['win_count'],
          ids,
          provenance or None,
      )
  return accs


def summarize(
    acc: buckets_lib.BucketAccumulator,
    *,
    step: int | None = None,
    reference: dict[str, np.ndarray] | None = None,
) -> EvalOutput:
  """The results of one accumulator.

  Args:
    acc: the accumulator of one pass (`accumulate`).
    step: the training step recorded in the results; None if unknown.
    reference: the synthetic source's `data.reference_losses` for the
      window length L (`bayes_loss`, `filter_loss`, each `[L]`), or None.

  Returns:
    An `EvalOutput` with `results` (`step`, `buckets`, `overall`,
    `degradation`), `per_position` and `per_window`.
  """
  per_position = acc.per_position()
  per_window = acc.per_window()
  per_position.update(reference or {})
  return EvalOutput(
      {
          'step': step,
          'buckets': acc.buckets(reference),
          'overall': buckets_lib.overall(per_window),
          'degradation': inference.degradation(per_window),
      },
      per_position,
      per_window,
  )


def thin_buckets(rows: Sequence[dict[str, Any]]) -> list[str]:
  """Warnings about buckets too thin to trust.

  Args:
    rows: results.json bucket rows, each with `start`, `end`, `tokens` and
      `windows`.

  Returns:
    Up to two messages, about buckets with no scored token and buckets with
    fewer than `MIN_BUCKET_WINDOWS` windows (naming the fix); empty if none.
  """
  empty = [
      f"[{row['start']}, {row['end']})" for row in rows if not row['tokens']
  ]
  thin = [
      row['windows']
      for row in rows
      if row['tokens'] and row['windows'] < MIN_BUCKET_WINDOWS
  ]
  warnings = []
  if empty:
    warnings.append(
        f'{len(empty)} bucket(s) have no scored token'
        f" ({', '.join(empty)}): no window reaches them; use longer"
        ' documents or other bucket edges.'
    )
  if thin:
    warnings.append(
        f'{len(thin)} of {len(rows)} bucket(s) have fewer than'
        f' {MIN_BUCKET_WINDOWS} windows (min {min(thin)}):'
        ' their intervals are unreliable; evaluate more windows'
        ' (eval.num_windows: eval.py --num_windows N, train.py'
        ' --config.eval.num_windows=N).'
    )
  return warnings


def eval_settings(
    config: config_lib.RunConfig, overrides: dict[str, Any]
) -> dict[str, Any]:
  """The evaluation settings, resolved and checked.

  Changed fields pass the config's own checks (`config.EvalConfig`,
  `config.check_across_sections`); the split and the offsets are checked
  here.

  Args:
    config: the run config (its `eval`, `data` and `model` sections).
    overrides: eval.py's options (`SETTINGS_KEYS`, `batch_size`,
      `bucket_size`, `bucket_edges` or `offsets`) replacing the config's;
      None keeps the config's.

  Returns:
    A dict of the settings `SETTINGS_KEYS`, `batch_size`, `bucket_size`,
    `bucket_edges` and `offsets` (sorted distinct ints, or None), with 0
    (`window_len`, `min_doc_len`, `min_start`) resolved to their defaults.

  Raises:
    ValueError: a setting the config's checks refuse, offsets outside
      `[0, window_len)` or an unknown split; the message names the setting
      and the fix.
  """
  given = {k: v for k, v in overrides.items() if v is not None}
  split = given.pop('split', config.data.eval_split)
  offsets = sorted({int(k) for k in given.pop('offsets', None) or ()})
  if 'policy' in given:
    given['position_policy'] = given.pop('policy')
  ev = config.eval
  if given:
    ev = dataclasses.replace(ev, **given)
    config_lib.check_across_sections(dataclasses.replace(config, eval=ev))
  window_len = ev.window_len or config.model.max_len
  if offsets and not 0 <= offsets[0] <= offsets[-1] < window_len:
    raise ValueError(
        f'offsets {offsets} must lie in [0, {window_len}): the probe scores '
        'the first window_len - K tokens; the largest valid '
        f'offset is {window_len - 1}.'
    )
  data_lib.corpus.check_split(config.data, split)
  min_doc_len, min_start = data_lib.windows.deep_limits(
      window_len, ev.min_doc_len, ev.min_start
  )
  return {
      'split': split,
      'policy': ev.position_policy,
      'num_windows': ev.num_windows,
      'window_len': window_len,
      'window_start': ev.window_start,
      'min_doc_len': min_doc_len,
      'min_start': min_start,
      'seed': ev.seed,
      'batch_size': ev.batch_size,
      'bucket_size': ev.bucket_size,
      'bucket_edges': ev.bucket_edges,
      'offsets': offsets or None,
  }


def make_batches(
    config: config_lib.RunConfig, s: dict[str, Any]
) -> tuple[dict[str, np.ndarray], ...]:
  """The evaluation windows of the settings, built once per process.

  Args:
    config: the run config (its `data` section picks the source).
    s: settings from `eval_settings`.

  Returns:
    Read-only batches (`data.make_eval_batches`) of `[batch_size, window_len]`
    `inputs`, `targets`, `positions`, `segment_ids`, `loss_mask`, and
    `[batch_size]` `PROVENANCE_KEYS` (padding rows: doc -1).
  """
  return _batches(
      config.data,
      split=s['split'],
      policy=s['policy'],
      num_windows=s['num_windows'],
      window_len=s['window_len'],
      window_start=s['window_start'],
      min_doc_len=s['min_doc_len'],
      min_start=s['min_start'],
      seed=s['seed'],
      batch_size=s['batch_size'],
  )


# Keyed by the (frozen) data section and the settings.
@functools.lru_cache(maxsize=4)
def _batches(
    data_config: config_lib.DataConfig, **settings
) -> tuple[dict[str, np.ndarray], ...]:
  return tuple(data_lib.make_eval_batches(data_config, **settings))


def expected_params(model) -> Any:
  """The parameter tree a linen model expects, without initializing it.

  Args:
    model: a linen `model.TransformerLM`.

  Returns:
    The `params` tree of `jax.ShapeDtypeStruct` leaves.
  """
  x = jnp.zeros((1, 2), jnp.int32)
  return jax.eval_shape(lambda: model.init(jax.random.key(0), x, x))['params']


def run_evaluation(
    model,
    params,
    config: config_lib.RunConfig,
    *,
    step: int | None = None,
    offsets: Sequence[int] | None = None,
    mesh=None,
    progress: str = '',
    **overrides,
) -> EvalOutput:
  """Loss by position bucket of a model on held-out windows.

  Args:
    model: a linen `model.TransformerLM`.
    params: its parameter tree; it must fit `model` (`expected_params`),
      checked once where it is restored (eval.py: `checkpointing.check_model`
      against the run's own model).
    config: the run config (`eval`, `data` and `model` sections).
    step: the training step recorded in the results.
    offsets: the offset probe's shifts K (scored on windows of
      `window_len - max K` tokens, paired against the smallest K), or None
      for no probe.
    mesh: the device mesh; None makes one over all devices.
    progress: a name for a bar over the batches of each pass on stderr; ''
      shows none.
    **overrides: `eval_settings` keys replacing the config's (None keeps the
      config's).

  Returns:
    The `EvalOutput`; its results hold `settings`, `warnings`
    (`thin_buckets`) and, with offsets, `offset_probe`.

  Raises:
    ValueError: settings `eval_settings` refuses.
  """
  s = eval_settings(config, dict(overrides, offsets=offsets))
  apply_fn = model_apply_fn(model)
  offsets = s['offsets']
  full_edges = buckets_lib.make_edges(
      s['window_len'], s['bucket_size'], s['bucket_edges']
  )
  # The same windows for both passes.
  windows = make_batches(config, s)

  def passes(length: int, shifts: Sequence[int], name: str) -> list[EvalOutput]:
    # The probe's windows and edges are clipped to `length`.
    edges = np.asarray([e for e in full_edges if e < length] + [length])
    batches = [
        {k: v[:, :length] if v.ndim == 2 else v for k, v in batch.items()}
        for batch in windows
    ]
    accs = accumulate(
        apply_fn,
        params,
        batches,
        edges,
        offsets=shifts,
        mesh=mesh,
        progress=f'{progress}: {name}' if progress else '',
    )
    reference = data_lib.reference_losses(config.data, length)
    return [summarize(acc, step=step, reference=reference) for acc in accs]

  num_windows = s['num_windows']
  (out,) = passes(s['window_len'], (0,), f'eval ({num_windows} windows)')
  out.results['settings'] = {k: s[k] for k in SETTINGS_KEYS}
  if 'doc' in out.per_window:
    out.results.update(
        buckets_lib.provenance_tables(out.per_window, s['window_len'])
    )
  out.results['warnings'] = thin_buckets(out.results['buckets'])
  for warning in out.results['warnings']:
    logging.warning('%s', warning)
  # K - K0 per bucket, paired over the same windows.
  if offsets:
    window = s['window_len'] - offsets[-1]
    probes = passes(
        window, offsets, f'offset probe (K = {", ".join(map(str, offsets))})'
    )
    out.results['offset_probe'] = {
        'note': OFFSET_NOTE,
        'window_len': window,
        'offsets': offsets,
        'by_offset': [
            dict(offset=offset, **probe.results)
            for offset, probe in zip(offsets, probes)
        ],
        'paired_vs_first': [
            {
                'offset': offset,
                'minus_offset': offsets[0],
                'buckets': inference.paired_difference(
                    probe.per_window,
                    probes[0].per_window,
                    (f'K={offset}', f'K={offsets[0]}'),
                ),
            }
            for offset, probe in zip(offsets[1:], probes[1:])
        ],
    }
    out.probe_windows = {k: p.per_window for k, p in zip(offsets, probes)}
    out.per_position.update(
        offsets=np.asarray(offsets),
        offset_loss=np.stack([probe.per_position['loss'] for probe in probes]),
        offset_count=np.stack(
            [probe.per_position['count'] for probe in probes]
        ),
    )
  return out
