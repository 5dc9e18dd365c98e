"""The training loop: ``train_and_evaluate(config, workdir)``.

Writes into ``workdir`` (docs/DESIGN.md):

* ``config.json`` — the resolved config;
* ``metrics.jsonl`` — one JSON object per log step (``step``, ``loss`` = mean train loss
  over the steps of the logging window, ``last_loss``, ``learning_rate``, ``grad_norm``,
  ``tokens``, ``tokens_per_sec``, ``elapsed``), and one ``{'step', 'eval'}`` row per periodic
  evaluation (``eval`` is ``evaluation.evaluate``'s results dict: ``overall``, ``buckets``);
* ``stats/window_STEP.npz`` — per-position statistics of each logging window
  (``flax_posemb.stats`` documents the fields; readable with numpy alone);
* ``tables/table_STEP.npy`` — the position table at step 0 and every log step;
* ``checkpoints/`` — Orbax (``flax_posemb.checkpointing``): periodic, at the end, and on
  SIGTERM; the ``stats`` item holds the exact int64 ``cumulative_count`` and the partial
  window so resumption is exact;
* ``tensorboard/`` — tensorboardX scalars.

Re-running on a workdir with checkpoints resumes from the latest one, logs so, and drops ``metrics.jsonl`` rows, window files and table snapshots after the restored step.
A truncated or corrupted latest checkpoint stops the run with an error naming it (nothing
is overwritten). A non-finite loss stops the run with ``NonFiniteLossError`` (nothing is
saved after it).
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import time
from typing import Any, Callable, Sequence

import jax
import ml_collections
import numpy as np
from absl import logging

from flax_posemb import checkpointing
from flax_posemb import data as data_lib
from flax_posemb import model as model_lib
from flax_posemb import stats as stats_lib
from flax_posemb.train_step import (TrainState, global_batch, init_state, make_mesh,
                                    make_model, make_train_step, check_batch_layout,
                                    zero_window)

Hook = Callable[[int, dict[str, float]], None]


class NonFiniteLossError(FloatingPointError):
  """The training loss or gradient norm became NaN/inf."""


def _to_host(x: jax.Array) -> np.ndarray:
  if getattr(x, 'is_fully_replicated', False):
    return np.asarray(x.addressable_data(0))
  if getattr(x, 'is_fully_addressable', True):
    return np.asarray(jax.device_get(x))
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _step_of(path: str) -> int:
  return int(re.search(r'_(\d+)\.(npy|npz)$', path).group(1))


def truncate_outputs(workdir: str, step: int) -> None:
  """Drops metrics rows, window files and table snapshots written after ``step``."""
  path = os.path.join(workdir, 'metrics.jsonl')
  if os.path.exists(path):
    with open(path) as f:
      rows = [line for line in f if line.strip()]
    keep = []
    for line in rows:
      try:
        if json.loads(line)['step'] <= step:
          keep.append(line)
      except (ValueError, KeyError):
        continue  # A half-written last line of a killed run.
    with open(path + '.tmp', 'w') as f:
      f.writelines(keep)
    os.replace(path + '.tmp', path)
  for pattern in ('stats/window_*.npz', 'tables/table_*.npy'):
    for p in glob.glob(os.path.join(workdir, pattern)):
      if _step_of(p) > step:
        os.remove(p)


def _validate(config: ml_collections.ConfigDict) -> model_lib.ModelConfig:
  for key in ('num_train_steps', 'log_every_steps', 'checkpoint_every_steps', 'batch_size'):
    if int(config[key]) < 1:
      raise ValueError(f'{key} must be >= 1, got {config[key]}.')
  mcfg = model_lib.ModelConfig.from_config(config.model)
  data_lib.validate_config(config.data, max_len=mcfg.max_len)
  vocab = data_lib.vocab_size(config.data)
  if vocab > mcfg.vocab_size:
    raise ValueError(f'The data has token ids up to {vocab - 1} but model.vocab_size='
                     f'{mcfg.vocab_size}. Set --config.model.vocab_size={vocab}.')
  return mcfg


class _Preemption:
  """Turns SIGTERM into a flag the loop checks after each step."""

  def __init__(self):
    self.requested = False
    self._old = None

  def __enter__(self):
    try:
      self._old = signal.signal(signal.SIGTERM, self._handle)
    except ValueError:  # Not the main thread: no handler.
      self._old = None
    return self

  def _handle(self, signum, frame):
    del signum, frame
    self.requested = True

  def __exit__(self, *exc):
    if self._old is not None:
      signal.signal(signal.SIGTERM, self._old)

  def agreed(self) -> bool:
    if jax.process_count() == 1:
      return self.requested
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    flags = multihost_utils.process_allgather(np.int32(self.requested))
    return bool(np.max(flags))


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *,
                       hooks: Sequence[Hook] = ()) -> dict[str, Any]:
  """Trains (or resumes) a run in ``workdir``; see the module docstring for outputs.

  Args:
    config: full config (``defaults.base()`` fields).
    workdir: run directory (created if missing).
    hooks: callables ``hook(step, metrics)`` run on the host after each step's metrics
      (``loss``, ``grad_norm``, ``learning_rate``, ``tokens``, ...) are read back.

  Returns:
    Dict ``step`` (last step done), ``loss`` (last logged window loss), ``resumed_from``
    (restored step or None), ``preempted`` (bool), ``eval`` (last evaluation results or None).

  Raises:
    NonFiniteLossError: the loss became NaN/inf (the last good checkpoint is kept).
    RuntimeError: the latest checkpoint is unreadable (named; nothing is changed).
    checkpointing.CheckpointMismatchError: ``workdir`` holds another model's checkpoint.
    ValueError: bad config values (named in the message).
  """
  mcfg = _validate(config)
  mesh = make_mesh()
  check_batch_layout(config, mesh)
  lead = jax.process_index() == 0
  model = make_model(config)
  init_rng, dropout_rng = jax.random.split(jax.random.key(int(config.seed)))
  state, tx, shardings = init_state(model, config, mesh, init_rng)
  train_step = make_train_step(model, tx, config, mesh, shardings)
  num_steps, max_len = int(config.num_train_steps), mcfg.max_len
  has_table = mcfg.position_embedding == 'learned'
  data_iter = data_lib.make_train_iterator(
      config.data, batch_size=int(config.batch_size), seed=int(config.seed),
      num_train_steps=num_steps, process_index=jax.process_index(),
      process_count=jax.process_count())

  os.makedirs(workdir, exist_ok=True)
  ckpt = checkpointing.Checkpointer(checkpointing.checkpoint_dir(workdir),
                                    max_to_keep=int(config.max_to_keep))
  host = dict(cumulative_count=np.zeros(max_len, np.int64), window_first_step=1,
              loss_sum=0.0, loss_steps=0, tokens=0, elapsed=0.0)
  resumed_from = None
  if ckpt.latest_step() is not None:
    r = ckpt.restore(abstract_params=state.params, abstract_opt_state=state.opt_state,
                     data_iter=data_iter)
    resumed_from = int(r['step'])
    unreadable = [s for s in ckpt.all_steps() if s > resumed_from]
    if unreadable:
      ckpt.close()
      dirs = ', '.join(str(ckpt.step_dir(s)) for s in unreadable)
      raise RuntimeError(
          f'The latest checkpoint(s) {dirs} are truncated or corrupted; the newest readable '
          f'one is step {resumed_from}. Nothing was changed. Move the bad directories aside '
          f'(e.g. mv {ckpt.step_dir(unreadable[-1])} /tmp/) and re-run to resume from step '
          f'{resumed_from}, or use a fresh --workdir.')
    saved = r['stats']
    window = {k: np.asarray(saved['window'][k]) for k in state.window}
    state = TrainState(step=jax.device_put(np.int32(resumed_from), shardings.step),
                       params=r['params'], opt_state=r['opt_state'],
                       window=jax.device_put(window, shardings.window))
    for k in host:
      host[k] = np.asarray(saved[k]).item() if np.ndim(saved[k]) == 0 else np.asarray(
          saved[k])
    logging.info('Resuming from the checkpoint of step %d in %s.', resumed_from,
                 ckpt.directory)
    print(f'Resuming from the checkpoint of step {resumed_from} in {ckpt.directory}.',
          flush=True)
    if lead:
      truncate_outputs(workdir, resumed_from)
  elif lead:
    truncate_outputs(workdir, 0)

  def save(step: int) -> bool:
    payload = dict(host, window={k: _to_host(v) for k, v in state.window.items()})
    return ckpt.save(step, params=state.params, opt_state=state.opt_state,
                     data_iter=data_iter, stats=payload, config=config.to_dict())

  def snapshot(step: int) -> None:
    if has_table:
      table = _to_host(model_lib.position_table(state.params))
      if lead:
        os.makedirs(os.path.join(workdir, 'tables'), exist_ok=True)
        np.save(os.path.join(workdir, 'tables', f'table_{step}.npy'), table)

  if lead:
    with open(os.path.join(workdir, 'config.json'), 'w') as f:
      f.write(config.to_json_best_effort(indent=2, sort_keys=True))
  start = resumed_from or 0
  if resumed_from is None:
    snapshot(0)
    save(0)

  writer = None
  if lead:
    from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
    writer = SummaryWriter(os.path.join(workdir, 'tensorboard'), purge_step=start + 1)
  bar = None
  if lead and config.progress_bar:
    from tqdm import tqdm  # pylint: disable=g-import-not-at-top
    bar = tqdm(total=num_steps, initial=start, desc='train', dynamic_ncols=True)

  last = dict(loss=float('nan'), grad_norm=float('nan'), learning_rate=float('nan'))
  result = dict(step=start, loss=None, resumed_from=resumed_from, preempted=False, eval=None)
  window_time = [time.time(), 0]  # wall clock at window start, tokens in window
  t0 = time.time()
  elapsed0 = float(host['elapsed'])

  def absorb(step: int, m: Any) -> None:
    m = {k: float(v) for k, v in jax.device_get(m).items()}
    if not m['finite'] > 0:
      raise NonFiniteLossError(
          f'Non-finite training loss at step {step} (loss={m["loss"]}, grad_norm='
          f'{m["grad_norm"]}). Stopped without saving; the last good checkpoint is step '
          f'{ckpt.latest_step()} in {ckpt.directory}. Lower optimizer.learning_rate, '
          'raise optimizer.warmup_steps or check the data.')
    host['loss_sum'] += m['loss']
    host['loss_steps'] += 1
    host['tokens'] += int(m['tokens'])
    window_time[1] += m['tokens']
    last.update(m)
    for hook in hooks:
      hook(step, m)

  def log(step: int) -> None:
    nonlocal state
    now = time.time()
    host['elapsed'] = elapsed0 + now - t0
    row = dict(step=step, loss=host['loss_sum'] / max(host['loss_steps'], 1),
               last_loss=last['loss'], learning_rate=last['learning_rate'],
               grad_norm=last['grad_norm'], tokens=int(host['tokens']),
               tokens_per_sec=window_time[1] / max(now - window_time[0], 1e-9),
               elapsed=host['elapsed'])
    window = {k: _to_host(v) for k, v in state.window.items()}
    host['cumulative_count'] = host['cumulative_count'] + window.get(
        'count', np.zeros(max_len, np.int64)).astype(np.int64)
    if lead:
      stats_lib.save_window(stats_lib.window_path(workdir, step), window, step=step,
                            first_step=int(host['window_first_step']),
                            cumulative_count=host['cumulative_count'])
      with open(os.path.join(workdir, 'metrics.jsonl'), 'a') as f:
        f.write(json.dumps(row) + '\n')
      for k in ('loss', 'learning_rate', 'grad_norm', 'tokens_per_sec'):
        writer.add_scalar(f'train/{k}', row[k], step)
      if bar is not None:
        bar.set_postfix(loss=f'{row["loss"]:.4f}', tok_s=f'{row["tokens_per_sec"]:.0f}')
    snapshot(step)
    state = state.replace(window=jax.device_put(zero_window(max_len, config.collect_stats),
                                                shardings.window))
    host.update(window_first_step=step + 1, loss_sum=0.0, loss_steps=0)
    window_time[:] = [now, 0]
    result['loss'] = row['loss']

  def evaluate(step: int) -> None:
    from flax_posemb import evaluation  # pylint: disable=g-import-not-at-top
    res = evaluation.evaluate(model, state.params, config, step=step)
    res = json.loads(json.dumps(res, default=float))
    result['eval'] = res
    if lead:
      with open(os.path.join(workdir, 'metrics.jsonl'), 'a') as f:
        f.write(json.dumps(dict(step=step, eval=res)) + '\n')
      overall = res.get('overall', {})
      if isinstance(overall, dict) and 'loss' in overall:
        writer.add_scalar('eval/loss', overall['loss'], step)

  pending = None
  try:
    with _Preemption() as preempt:
      for step in range(start + 1, num_steps + 1):
        batch = global_batch(next(data_iter), mesh, model.config.max_len)
        state, metrics = train_step(state, batch, jax.random.fold_in(dropout_rng, step))
        if pending is not None:  # Read the previous step back while this one runs.
          absorb(*pending)
        pending = (step, metrics)
        if bar is not None:
          bar.update(1)
        stop = preempt.agreed()
        is_log = step % int(config.log_every_steps) == 0 or step == num_steps
        is_eval = int(config.eval_every_steps) > 0 and (
            step % int(config.eval_every_steps) == 0)
        is_ckpt = step % int(config.checkpoint_every_steps) == 0 or step == num_steps
        if is_log or is_eval or is_ckpt or stop:
          absorb(*pending)
          pending = None
        if is_log:
          log(step)
        if is_eval:
          evaluate(step)
        if is_ckpt or stop:
          save(step)
        result['step'] = step
        if stop:
          ckpt.wait_until_finished()
          logging.warning('SIGTERM received: saved the checkpoint of step %d; exiting.', step)
          print(f'SIGTERM: saved the checkpoint of step {step} in {ckpt.directory}.',
                flush=True)
          result['preempted'] = True
          break
      if pending is not None:
        absorb(*pending)
  finally:
    if bar is not None:
      bar.close()
    if writer is not None:
      writer.close()
    ckpt.close()
  return result
