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
  SIGTERM; the ``stats`` item holds the partial window and the host counters (exact int64
  ``cumulative_count``) so resumption is exact;
* ``tensorboard/`` — tensorboardX scalars.

Re-running on a workdir with checkpoints resumes from the latest one, logs so, and drops
``metrics.jsonl`` rows, window files and table snapshots after the restored step. A
truncated or corrupted latest checkpoint stops the run with an error naming it (nothing is
overwritten). A non-finite loss stops the run with ``NonFiniteLossError`` (nothing is saved
after it).
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
from flax_posemb import optim as optim_lib
from flax_posemb import sharding
from flax_posemb import stats as stats_lib
from flax_posemb import train_step as step_lib

Hook = Callable[[int, dict[str, float]], None]
_OUTPUTS = {'stats': stats_lib.WINDOW_GLOB, 'tables': 'table_*.npy'}


class NonFiniteLossError(FloatingPointError):
  """The training loss or gradient norm became NaN/inf."""


def truncate_outputs(workdir: str, step: int) -> None:
  """Drops metrics rows, window files and table snapshots written after ``step``."""
  path = os.path.join(workdir, 'metrics.jsonl')
  if os.path.exists(path):
    keep = []
    with open(path) as f:
      for line in f:
        try:
          if json.loads(line)['step'] <= step:
            keep.append(line)
        except (ValueError, KeyError):
          continue  # A half-written last line of a killed run.
    with open(path + '.tmp', 'w') as f:
      f.writelines(keep)
    os.replace(path + '.tmp', path)
  for sub, pattern in _OUTPUTS.items():
    for p in glob.glob(os.path.join(workdir, sub, pattern)):
      if int(re.search(r'_(\d+)\.np[yz]$', p).group(1)) > step:
        os.remove(p)


def validate(config: ml_collections.ConfigDict) -> model_lib.ModelConfig:
  """Checks the config before anything is built; returns the model config."""
  for key in ('num_train_steps', 'log_every_steps', 'checkpoint_every_steps', 'batch_size',
              'max_to_keep'):
    if int(config[key]) < 1:
      raise ValueError(f'{key} must be >= 1, got {config[key]}.')
  mcfg = model_lib.ModelConfig.from_config(config.model)
  data_lib.validate_config(config.data, max_len=mcfg.max_len)
  vocab = data_lib.vocab_size(config.data)
  if vocab > mcfg.vocab_size:
    raise ValueError(f'The data has token ids up to {vocab - 1} but model.vocab_size='
                     f'{mcfg.vocab_size}. Set --config.model.vocab_size={vocab}.')
  optim_lib.validate(config)
  if int(config.eval_every_steps) > 0:
    _validate_eval(config, mcfg)
  return mcfg


def _validate_eval(config: ml_collections.ConfigDict, mcfg: model_lib.ModelConfig) -> None:
  """The periodic evaluation's settings, and enough evaluation documents, checked at startup
  (not at the first eval step, after a checkpoint interval of training)."""
  from flax_posemb import buckets as buckets_lib  # pylint: disable=g-import-not-at-top
  from flax_posemb import evaluation  # pylint: disable=g-import-not-at-top
  s = evaluation._eval_settings(config, {})  # pylint: disable=protected-access
  if not 1 <= int(s['window_len']) <= mcfg.max_len:
    raise ValueError(f"eval.window_len={s['window_len']} must be in [1, model.max_len="
                     f'{mcfg.max_len}]; 0 means model.max_len.')
  try:
    buckets_lib.make_edges(int(s['window_len']), int(s['bucket_size']), s['bucket_edges'])
  except ValueError as e:
    raise ValueError(f'eval.bucket_size / eval.bucket_edges: {e}') from None
  for key in ('num_windows', 'batch_size'):
    if int(s[key]) < 1:
      raise ValueError(f'eval.{key} must be >= 1, got {s[key]}.')
  # Builds (and drops) the evaluation windows: too few documents fail now, not at step
  # eval_every_steps.
  data_lib.make_eval_batches(
      config.data, split=s['split'], window_len=int(s['window_len']),
      num_windows=int(s['num_windows']), batch_size=int(s['batch_size']),
      policy=s['policy'], seed=int(s['seed']))


class StatsLog:
  """Host side of the statistics and metrics: windows, counters, metrics rows, TensorBoard.

  The device sums ``PositionStats`` between log steps (``TrainState.stats``); at each log
  step ``flush`` reads them once, adds the exact int64 cumulative counts, writes the window
  file and the metrics row. ``counters`` (with the device window) is the checkpoint's
  ``stats`` item, so a resumed run continues the same window.
  """

  def __init__(self, workdir: str, num_positions: int, lead: bool, start: int):
    self.workdir, self.lead = workdir, lead
    self.counters = dict(cumulative_count=np.zeros(num_positions, np.int64),
                         window_first_step=1, loss_sum=0.0, loss_steps=0, tokens=0,
                         elapsed=0.0)
    self.last: dict[str, float] = {}
    self._writer = None
    if lead:
      from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
      self._writer = SummaryWriter(os.path.join(workdir, 'tensorboard'), purge_step=start + 1)
    self._clock = (time.time(), 0.0)  # window start, tokens in window
    self._t0, self._elapsed0 = time.time(), 0.0

  def restore(self, saved: dict[str, Any]) -> None:
    """Loads the counters of a checkpoint's ``stats`` item."""
    for k in self.counters:
      v = np.asarray(saved[k])
      self.counters[k] = v.item() if v.ndim == 0 else v
    self._elapsed0 = float(self.counters['elapsed'])

  def add_step(self, metrics: dict[str, float]) -> None:
    """Accounts one step's metrics (already on the host)."""
    self.counters['loss_sum'] += metrics['loss']
    self.counters['loss_steps'] += 1
    self.counters['tokens'] += int(metrics['tokens'])
    self._clock = (self._clock[0], self._clock[1] + metrics['tokens'])
    self.last = metrics

  def flush(self, step: int, window: stats_lib.PositionStats) -> dict[str, Any]:
    """Writes the window file and metrics row of the window ending at ``step``."""
    c, now = self.counters, time.time()
    c['elapsed'] = self._elapsed0 + now - self._t0
    row = dict(step=step, loss=c['loss_sum'] / max(c['loss_steps'], 1),
               last_loss=self.last.get('loss'), learning_rate=self.last.get('learning_rate'),
               grad_norm=self.last.get('grad_norm'), tokens=int(c['tokens']),
               tokens_per_sec=self._clock[1] / max(now - self._clock[0], 1e-9),
               elapsed=c['elapsed'])
    fields = window.to_numpy()
    c['cumulative_count'] = c['cumulative_count'] + fields['count']
    if self.lead:
      window.save(stats_lib.window_path(self.workdir, step), step=step,
                  first_step=int(c['window_first_step']),
                  cumulative_count=c['cumulative_count'])
      self.write({'step': step, **row})
      for k in ('loss', 'learning_rate', 'grad_norm', 'tokens_per_sec'):
        self._writer.add_scalar(f'train/{k}', row[k], step)
    c.update(window_first_step=step + 1, loss_sum=0.0, loss_steps=0)
    self._clock = (now, 0.0)
    return row

  def write(self, row: dict[str, Any]) -> None:
    """Appends one row to metrics.jsonl (and eval loss to TensorBoard)."""
    if not self.lead:
      return
    with open(os.path.join(self.workdir, 'metrics.jsonl'), 'a') as f:
      f.write(json.dumps(row, default=float) + '\n')
    overall = row.get('eval', {}).get('overall', {})
    if isinstance(overall, dict) and 'loss' in overall:
      self._writer.add_scalar('eval/loss', overall['loss'], row['step'])

  def close(self) -> None:
    if self._writer is not None:
      self._writer.close()


def restore_or_init(ckpt: checkpointing.Checkpointer, state: step_lib.TrainState,
                    shardings: step_lib.TrainState, data_iter: Any
                    ) -> tuple[step_lib.TrainState, int | None, dict[str, Any]]:
  """The latest checkpoint's state (and data position), or ``state`` unchanged.

  Returns:
    ``(state, resumed_from, counters)``: ``resumed_from`` is None for a fresh run;
    ``counters`` are the ``StatsLog`` counters saved with the checkpoint ({} if fresh).

  Raises:
    RuntimeError: a checkpoint newer than the newest readable one exists (named).
    ValueError: the checkpoint's statistics do not match ``collect_stats``.
  """
  if ckpt.latest_step() is None:
    return state, None, {}
  r = ckpt.restore(abstract_params=state.params, abstract_opt_state=state.opt_state,
                   data_iter=data_iter)
  step = int(r['step'])
  unreadable = [s for s in ckpt.all_steps() if s > step]
  if unreadable:
    dirs = ', '.join(str(ckpt.step_dir(s)) for s in unreadable)
    raise RuntimeError(
        f'The latest checkpoint(s) {dirs} are truncated or corrupted; the newest readable '
        f'one is step {step}. Nothing was changed. Move the bad directories aside '
        f'(e.g. mv {ckpt.step_dir(unreadable[-1])} /tmp/) and re-run to resume from step '
        f'{step}, or use a fresh --workdir.')
  window = stats_lib.PositionStats.from_mapping(r['stats']['window'])
  if set(window) != set(state.stats):
    raise ValueError(f'The checkpoint of step {step} holds statistics {sorted(window)} but '
                     f'this config collects {sorted(state.stats)}; resume with the '
                     'collect_stats value the run was started with.')
  window = jax.tree.map(lambda v, z: np.asarray(v, z.dtype), window, state.stats)
  return step_lib.TrainState(
      step=jax.device_put(np.int32(step), shardings.step), params=r['params'],
      opt_state=r['opt_state'], stats=jax.device_put(window, shardings.stats)), step, r['stats']


class _Preemption:
  """SIGTERM as a flag the loop checks after each step; on several hosts, Orbax's
  preemption sync point (JAX's preemption service) makes every host stop at the same step."""

  def __init__(self, ckpt: checkpointing.Checkpointer):
    self.requested, self._ckpt, self._old = False, ckpt, None

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

  def reached(self, step: int) -> bool:
    if jax.process_count() == 1:
      return self.requested
    return self._ckpt.reached_preemption(step)


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
  mcfg = validate(config)
  mesh = sharding.make_mesh()
  sharding.check_batch_layout(config, mesh)
  lead = jax.process_index() == 0
  model = step_lib.make_model(config)
  init_rng, dropout_rng = jax.random.split(jax.random.key(int(config.seed)))
  state, tx, shardings = step_lib.init_state(model, config, mesh, init_rng)
  train_step = step_lib.make_train_step(model, tx, config, mesh, shardings)
  num_steps = int(config.num_train_steps)
  data_iter = data_lib.make_train_iterator(
      config.data, batch_size=int(config.batch_size), seed=int(config.seed),
      num_train_steps=num_steps, process_index=jax.process_index(),
      process_count=jax.process_count())
  os.makedirs(workdir, exist_ok=True)
  ckpt = checkpointing.Checkpointer(checkpointing.checkpoint_dir(workdir),
                                    max_to_keep=int(config.max_to_keep))
  try:
    state, resumed_from, counters = restore_or_init(ckpt, state, shardings, data_iter)
    log = StatsLog(workdir, mcfg.max_len, lead, resumed_from or 0)
    if resumed_from is not None:
      log.restore(counters)
      logging.info('Resuming from the checkpoint of step %d in %s.', resumed_from,
                   ckpt.directory)
      print(f'Resuming from the checkpoint of step {resumed_from} in {ckpt.directory}.',
            flush=True)
    if lead:
      truncate_outputs(workdir, resumed_from or 0)
      with open(os.path.join(workdir, 'config.json'), 'w') as f:
        f.write(config.to_json_best_effort(indent=2, sort_keys=True))
    loop = _Loop(config, workdir, model, mesh, ckpt, log, data_iter, hooks)
    # A fresh buffer per window: the step donates its state.
    loop.zero_stats = lambda: jax.device_put(stats_lib.PositionStats.zeros(
        mcfg.max_len, collect=bool(config.collect_stats)), shardings.stats)
    return loop.run(state, train_step, dropout_rng, resumed_from)
  finally:
    ckpt.close()


class _Loop:
  """The step loop and what happens at log, eval and checkpoint steps."""

  def __init__(self, config, workdir, model, mesh, ckpt, log, data_iter, hooks):
    self.config, self.workdir, self.model, self.mesh = config, workdir, model, mesh
    self.ckpt, self.log, self.data_iter, self.hooks = ckpt, log, data_iter, hooks
    self.lead = jax.process_index() == 0

  def save(self, state: step_lib.TrainState, step: int) -> None:
    payload = dict(self.log.counters, window=state.stats.to_numpy())
    self.ckpt.save(step, params=state.params, opt_state=state.opt_state,
                   data_iter=self.data_iter, stats=payload, config=self.config.to_dict())

  def snapshot(self, state: step_lib.TrainState, step: int) -> None:
    if self.model.config.position_embedding != 'learned':
      return
    table = sharding.to_host(model_lib.position_table(state.params))
    if self.lead:
      os.makedirs(os.path.join(self.workdir, 'tables'), exist_ok=True)
      np.save(os.path.join(self.workdir, 'tables', f'table_{step}.npy'), table)

  def absorb(self, step: int, metrics: Any) -> None:
    m = {k: float(v) for k, v in jax.device_get(metrics).items()}
    if not m['finite'] > 0:
      raise NonFiniteLossError(
          f'Non-finite training loss at step {step} (loss={m["loss"]}, grad_norm='
          f'{m["grad_norm"]}). Stopped without saving; the last good checkpoint is step '
          f'{self.ckpt.latest_step()} in {self.ckpt.directory}. Lower '
          'optimizer.learning_rate, raise optimizer.warmup_steps or check the data.')
    self.log.add_step(m)
    for hook in self.hooks:
      hook(step, m)

  def evaluate(self, state: step_lib.TrainState, step: int) -> dict[str, Any]:
    from flax_posemb import evaluation  # pylint: disable=g-import-not-at-top
    res = evaluation.evaluate(self.model, state.params, self.config, step=step)
    res = json.loads(json.dumps(res, default=float))
    self.log.write(dict(step=step, eval=res))
    return res

  def run(self, state, train_step, dropout_rng, resumed_from) -> dict[str, Any]:
    c, start = self.config, resumed_from or 0
    num_steps = int(c.num_train_steps)
    if resumed_from is None:
      self.snapshot(state, 0)
      self.save(state, 0)
    result = dict(step=start, loss=None, resumed_from=resumed_from, preempted=False, eval=None)
    bar = None
    if self.lead and c.progress_bar:
      from tqdm import tqdm  # pylint: disable=g-import-not-at-top
      bar = tqdm(total=num_steps, initial=start, desc='train', dynamic_ncols=True)
    pending = None
    try:
      with _Preemption(self.ckpt) as preempt:
        for step in range(start + 1, num_steps + 1):
          batch = sharding.global_batch(next(self.data_iter), self.mesh,
                                        self.model.config.max_len)
          state, metrics = train_step(state, batch, jax.random.fold_in(dropout_rng, step))
          if pending is not None:  # Read the previous step back while this one runs.
            self.absorb(*pending)
          pending = (step, metrics)
          stop = preempt.reached(step)
          is_log = step % int(c.log_every_steps) == 0 or step == num_steps
          is_eval = int(c.eval_every_steps) > 0 and step % int(c.eval_every_steps) == 0
          is_ckpt = step % int(c.checkpoint_every_steps) == 0 or step == num_steps or stop
          if is_log or is_eval or is_ckpt:
            self.absorb(*pending)
            pending = None
          if is_log:
            result['loss'] = self.log.flush(step, state.stats)['loss']
            self.snapshot(state, step)
            state = state.replace(stats=self.zero_stats())
            if bar is not None:
              bar.set_postfix(loss=f'{result["loss"]:.4f}')
          if is_eval:
            result['eval'] = self.evaluate(state, step)
          if is_ckpt:
            self.save(state, step)
          result['step'] = step
          if bar is not None:
            bar.update(1)
          if stop:
            self.ckpt.wait_until_finished()
            logging.warning('SIGTERM received: saved the checkpoint of step %d; exiting.', step)
            print(f'SIGTERM: saved the checkpoint of step {step} in {self.ckpt.directory}.',
                  flush=True)
            result['preempted'] = True
            break
        if pending is not None:
          self.absorb(*pending)
    finally:
      if bar is not None:
        bar.close()
      self.log.close()
    return result
