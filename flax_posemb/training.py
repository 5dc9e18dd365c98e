"""The training loop: ``train_and_evaluate(config, workdir)``.

Writes into ``workdir`` (docs/DESIGN.md):

* ``config.json`` — the resolved config;
* ``metrics.jsonl`` — one JSON object per log step (``step``, ``loss`` = mean train loss
  over the steps of the logging window, ``last_loss``, ``learning_rate``, ``grad_norm``,
  ``tokens``, ``tokens_per_sec``, ``elapsed``), and one ``{'step', 'eval'}`` row per periodic
  evaluation (``eval`` is ``evaluation.run_evaluation``'s results dict: ``overall``, ``buckets``);
* ``stats/window_STEP.npz`` — per-position statistics of each logging window
  (``flax_posemb.stats`` documents the fields; readable with numpy alone);
* ``tables/table_STEP.npy`` — the position table at step 0 and every log step;
* ``checkpoints/`` — Orbax (``flax_posemb.checkpointing``): periodic, at the end, and on
  SIGTERM; the ``stats`` item holds the partial window and the host counters (exact int64
  ``cumulative_count``) so resumption is exact;
* ``tensorboard/`` — TensorBoard events (`TensorBoard`: written by the calling thread).

Re-running on a workdir with checkpoints resumes from the latest one, logs so, and drops
``metrics.jsonl`` rows, window files and table snapshots after the restored step. A
damaged latest checkpoint stops the run with an error naming it (nothing is
overwritten). A non-finite loss stops the run with ``NonFiniteLossError`` (nothing is saved
after it).
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import struct
import time
from typing import Any, Callable, Sequence

import jax
import ml_collections
import numpy as np
from absl import logging

from flax_posemb import auto as auto_lib
from flax_posemb import checkpointing
from flax_posemb import cli
from flax_posemb import data as data_lib
from flax_posemb import model as model_lib
from flax_posemb import outputs
from flax_posemb import optim as optim_lib
from flax_posemb import sharding
from flax_posemb import stats as stats_lib
from flax_posemb import train_step as step_lib
from flax_posemb import workdir as workdir_lib

Hook = Callable[[int, dict[str, float]], None]


class NonFiniteLossError(FloatingPointError):
  """The training loss or gradient norm became NaN/inf."""


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
  if not math.isfinite(float(config.divergence_loss)):
    raise ValueError(f'divergence_loss must be finite, got {config.divergence_loss}.')
  optim_lib.validate(config)
  if int(config.eval_every_steps) > 0:
    _validate_eval(config, mcfg)
  return mcfg


def resolve_auto(config: ml_collections.ConfigDict, workdir: str) -> ml_collections.ConfigDict:
  """A copy of ``config`` with its auto fields (attention, microbatches) made concrete for this
  platform (``auto.resolve_config``), so ``config.json`` records what runs; a resume keeps the
  values its ``config.json`` recorded."""
  config = config.copy_and_resolve_references()
  saved = workdir_lib.saved_config(workdir) if os.path.isdir(workdir) else None
  for key, (_, value) in auto_lib.resolve_config(config, saved=saved).items():
    logging.info('%s: auto -> %r (recorded in config.json)', key, value)
  return config


def divergence_bound(config: ml_collections.ConfigDict) -> float:
  """Loss above which training stops as diverged: ``divergence_loss``, or three times the
  loss of a uniform guess over the vocabulary (a freshly initialized model starts near one)."""
  bound = float(config.divergence_loss)
  return bound if bound >= 0 else 3.0 * math.log(int(config.model.vocab_size))


def _validate_eval(config: ml_collections.ConfigDict, mcfg: model_lib.ModelConfig) -> None:
  """The periodic evaluation's settings, and enough evaluation documents, checked at startup
  (not at the first eval step, after a checkpoint interval of training)."""
  from flax_posemb import buckets as buckets_lib  # pylint: disable=g-import-not-at-top
  from flax_posemb import evaluation  # pylint: disable=g-import-not-at-top
  s = evaluation.eval_settings(config, {})
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
  # Builds the evaluation windows (kept for the periodic evaluations): too few documents
  # fail now, not at step eval_every_steps.
  evaluation.make_batches(config, s)


class TensorBoard:
  """TensorBoard events of a run, appended by the caller's thread a whole record at a time
  (`outputs.append_whole`), in the format of tensorboardX's writer.

  Not tensorboardX's SummaryWriter: it writes from a thread of its own and flushes again at
  exit, so a full disk reached it as more tracebacks after the run's own (the thread's, then
  atexit's). Here a failed write raises in the caller, once, like every other output.
  """

  def __init__(self, logdir: str, purge_step: int | None = None):
    from tensorboardX import summary  # pylint: disable=g-import-not-at-top
    from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
    self.logdir, self._summary, self._pb = logdir, summary, event_pb2
    os.makedirs(logdir, exist_ok=True)
    self.path = os.path.join(logdir, f'events.out.tfevents.{time.time():.0f}.'
                             f'{socket.gethostname()}')
    self._add(event_pb2.Event(file_version='brain.Event:2'))
    if purge_step is not None:  # TensorBoard drops later events of an earlier attempt.
      self._add(event_pb2.Event(step=purge_step, session_log=event_pb2.SessionLog(
          status=event_pb2.SessionLog.START)))

  def _add(self, event: Any, summary: Any = None) -> None:
    from tensorboardX.record_writer import masked_crc32c  # pylint: disable=g-import-not-at-top
    event.wall_time = time.time()
    if summary is not None:
      event.summary.CopyFrom(summary)
    data = event.SerializeToString()
    head = struct.pack('<Q', len(data))  # TFRecord framing: length, crc, payload, crc
    outputs.append_whole(self.path, head + struct.pack('<I', masked_crc32c(head)) + data
                         + struct.pack('<I', masked_crc32c(data)))

  def scalar(self, tag: str, value: float, step: int) -> None:
    self._add(self._pb.Event(step=int(step)), self._summary.scalar(tag, value))

  def figure(self, tag: str, figure: Any, step: int) -> None:
    """A matplotlib figure as an image (the figure is closed)."""
    from tensorboardX.utils import figure_to_image  # pylint: disable=g-import-not-at-top
    self._add(self._pb.Event(step=int(step)), self._summary.image(
        tag, figure_to_image(figure), dataformats='CHW'))

  def hparams(self, hparams: dict[str, Any], metrics: dict[str, float]) -> None:
    """The run's hyperparameters and final metrics, in ``LOGDIR/hparams`` (TensorBoard's
    HParams tab), as tensorboardX's ``add_hparams(name='hparams')`` writes them."""
    run = TensorBoard(os.path.join(self.logdir, 'hparams'))
    for s in self._summary.hparams(hparams, metrics):  # experiment, session start and end
      run._add(self._pb.Event(step=0), s)  # pylint: disable=protected-access
    for k, v in metrics.items():
      run.scalar(k, v, 0)


class StatsLog:
  """Host side of the statistics and metrics: windows, counters, metrics rows, TensorBoard.

  The device sums ``PositionStats`` between log steps (``TrainState.stats``); at each log
  step ``flush`` reads them once, adds the exact int64 cumulative counts, writes the window
  file and the metrics row. ``counters`` (with the device window) is the checkpoint's
  ``stats`` item, so a resumed run continues the same window.
  """

  def __init__(self, workdir: str, num_positions: int, lead: bool, start: int,
               progress_bar: bool = False):
    self.workdir, self.lead, self.progress_bar = workdir, lead, progress_bar and lead
    self.counters = dict(cumulative_count=np.zeros(num_positions, np.int64),
                         window_first_step=1, loss_sum=0.0, loss_steps=0, tokens=0,
                         elapsed=0.0)
    self.last: dict[str, float] = {}
    self.last_row: dict[str, Any] = {}  # the last training row written, with its step
    self.last_eval: dict[str, Any] | None = None
    self._tb = TensorBoard(os.path.join(workdir, 'tensorboard'), start + 1) if lead else None
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
    # Only `count` is read here; `save` copies the whole window to the host once.
    c['cumulative_count'] = c['cumulative_count'] + sharding.to_host(window['count']).astype(
        np.int64)
    if self.lead:
      window.save(stats_lib.window_path(self.workdir, step), step=step,
                  first_step=int(c['window_first_step']),
                  cumulative_count=c['cumulative_count'])
      self.write(row)
      for k in ('loss', 'learning_rate', 'grad_norm', 'tokens_per_sec'):
        self._tb.scalar(f'train/{k}', row[k], step)
    self.last_row = row
    c.update(window_first_step=step + 1, loss_sum=0.0, loss_steps=0)
    self._clock = (now, 0.0)
    if not self.progress_bar:  # The bar shows these; without it, one log line per window.
      logging.info('step %d: loss %.4f, learning rate %.3g, grad norm %.3g, %.0f tokens/s',
                   step, row['loss'], row['learning_rate'] or 0.0, row['grad_norm'] or 0.0,
                   row['tokens_per_sec'])
    return row

  def write(self, row: dict[str, Any]) -> None:
    """Appends one row to metrics.jsonl."""
    if self.lead:
      workdir_lib.append_row(self.workdir, row)

  def write_eval(self, step: int, results: dict[str, Any], per_position: dict[str, Any],
                 title: str) -> None:
    """Metrics row, console line and TensorBoard (overall and per-bucket loss, `recovered`,
    degradation, the loss-by-position figure) of one periodic evaluation."""
    self.write(dict(step=step, eval=results))
    o, d = results['overall'], results['degradation']
    lmb = d['last_minus_best']
    logging.info('eval step %d: loss %.4f +- %.4f nats/token; last - best bucket %s', step,
                 o['loss'], o['stderr'] or 0.0, '-' if lmb is None else f'{lmb:+.4f}')
    if not self.lead:
      return
    w = self._tb
    w.scalar('eval/loss', o['loss'], step)
    for k in ('last_minus_best', 'slope'):
      if d.get(k) is not None:
        w.scalar(f'eval/degradation/{k}', d[k], step)
    for b in results['buckets']:
      for k in ('loss', 'excess_loss', 'recovered'):
        if b.get(k) is not None:
          w.scalar(f'eval_bucket_{k}/{b["start"]:05d}-{b["end"]:05d}', b[k], step)
    from flax_posemb import plots  # pylint: disable=g-import-not-at-top  (matplotlib)
    w.figure('eval/loss_by_position', plots.loss_by_position_figure(
        per_position, results, title), step)
    self.last_eval = results

  def write_hparams(self, config: ml_collections.ConfigDict) -> None:
    """The config as TensorBoard hparams, with the last evaluation's loss as its metric."""
    if not self.lead:
      return
    flat = workdir_lib.flat_config(config)
    hparams = {k: v if isinstance(v, (int, float, str, bool)) else str(v)
               for k, v in flat.items()}
    ev = self.last_eval or {}
    metrics = {'hparam/eval_loss': (ev.get('overall') or {}).get('loss'),
               'hparam/last_minus_best': (ev.get('degradation') or {}).get('last_minus_best')}
    metrics = {k: v for k, v in metrics.items() if v is not None}  # none without an eval
    self._tb.hparams(hparams, metrics)


def restore_or_init(ckpt: checkpointing.Checkpointer, state: step_lib.TrainState,
                    shardings: step_lib.TrainState, data_iter: Any
                    ) -> tuple[step_lib.TrainState, int | None, dict[str, Any]]:
  """The latest checkpoint's state (and data position), or ``state`` unchanged.

  Returns:
    ``(state, resumed_from, counters)``: ``resumed_from`` is None for a fresh run;
    ``counters`` are the ``StatsLog`` counters saved with the checkpoint ({} if fresh).

  Raises:
    checkpointing.CheckpointDamagedError: the latest checkpoint is damaged (named).
    checkpointing.CheckpointMismatchError: it was written for another model or statistics.
  """
  if ckpt.latest_step() is None:
    return state, None, {}
  # No fallback: a damaged latest step stops the run (CheckpointDamagedError names it and
  # says how to resume from the previous one) instead of training over it.
  r = ckpt.restore(abstract_params=state.params, abstract_opt_state=state.opt_state,
                   data_iter=data_iter, fallback=False)
  step = int(r['step'])
  window = stats_lib.PositionStats.from_mapping(r['stats']['window'])
  if set(window) != set(state.stats):
    raise checkpointing.CheckpointMismatchError(
        f'The checkpoint of step {step} holds statistics {sorted(window)} but this config '
        f'collects {sorted(state.stats)}; resume with the collect_stats value the run was '
        'started with.')
  window = jax.tree.map(lambda v, z: np.asarray(v, z.dtype), window, state.stats)
  return step_lib.TrainState(
      step=jax.device_put(np.int32(step), shardings.step), params=r['params'],
      opt_state=r['opt_state'], stats=jax.device_put(window, shardings.stats)), step, r['stats']


class _Preemption:
  """SIGTERM as the loop sees it: the process's one handler (`cli.defer_sigterm`) on one host;
  on several, JAX's notifier owns SIGTERM and Orbax's sync point stops all at the same step."""

  def __init__(self, ckpt: checkpointing.Checkpointer):
    self.ckpt = ckpt

  @property
  def requested(self) -> bool:
    return cli.sigterm_requested()

  def reached(self, step: int) -> bool:
    return self.ckpt.reached_preemption(step) if jax.process_count() > 1 else self.requested


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
    NonFiniteLossError: the loss became NaN/inf or diverged (the last good checkpoint is kept).
    checkpointing.CheckpointDamagedError: the latest checkpoint is damaged (named; nothing is
      changed).
    checkpointing.CheckpointMismatchError: ``workdir`` holds another model's checkpoint.
    ValueError: bad config values, or a workdir that cannot be used as asked
      (``workdir.WorkdirError``; named in the message).
  """
  config = resolve_auto(config, workdir)
  mcfg = validate(config)
  mesh = sharding.make_mesh()
  sharding.check_batch_layout(config, mesh)
  lead = jax.process_index() == 0
  os.makedirs(workdir, exist_ok=True)
  with contextlib.ExitStack() as stack:
    if lead:
      stack.enter_context(workdir_lib.Lock(workdir))
    stack.enter_context(cli.defer_sigterm(install=jax.process_count() == 1))
    ckpt = stack.enter_context(checkpointing.Checkpointer(
        checkpointing.checkpoint_dir(workdir), max_to_keep=int(config.max_to_keep)))
    preempt = _Preemption(ckpt)
    # Before anything is restored or written, on every host (they read the same files, so
    # they all stop together): refuse what would lose work.
    if ckpt.latest_step() is None:
      workdir_lib.check_fresh_start(workdir)
      changes = {}
    else:
      changes = workdir_lib.check_resume_config(workdir, config, ckpt.latest_config())
    model = step_lib.make_model(config)
    init_rng, dropout_rng = jax.random.split(jax.random.key(int(config.seed)))
    state, tx, shardings = step_lib.init_state(model, config, mesh, init_rng)
    data_iter = data_lib.make_train_iterator(
        config.data, batch_size=int(config.batch_size), seed=int(config.seed),
        num_train_steps=int(config.num_train_steps), process_index=jax.process_index(),
        process_count=jax.process_count(), max_len=mcfg.max_len)
    state, resumed_from, counters = restore_or_init(ckpt, state, shardings, data_iter)
    log = StatsLog(workdir, mcfg.max_len, lead, resumed_from or 0, bool(config.progress_bar))
    if resumed_from is not None:
      log.restore(counters)
      logging.info('Resuming from the checkpoint of step %d in %s.', resumed_from,
                   ckpt.directory)
    if lead:
      workdir_lib.truncate_outputs(workdir, resumed_from or 0)
      workdir_lib.write_config(workdir, config)
      if changes:
        log.write({'step': resumed_from, 'config_change': changes})
    # A fresh buffer per window: the step donates its state.
    zero_stats = lambda: jax.device_put(stats_lib.PositionStats.zeros(  # noqa: E731
        mcfg.max_len, collect=bool(config.collect_stats)), shardings.stats)
    loop = _Loop(config, workdir, model, mesh, ckpt, log, data_iter, hooks, zero_stats)
    return loop.run(state, step_lib.make_train_step(model, tx, config, mesh, shardings),
                    dropout_rng, resumed_from, preempt)


class _Loop:
  """The step loop and what happens at log, eval and checkpoint steps."""

  def __init__(self, config, workdir, model, mesh, ckpt, log, data_iter, hooks, zero_stats):
    self.config, self.workdir, self.model, self.mesh = config, workdir, model, mesh
    self.ckpt, self.log, self.data_iter, self.hooks = ckpt, log, data_iter, hooks
    self.zero_stats = zero_stats
    self.lead = jax.process_index() == 0
    self.divergence = divergence_bound(config)

  def save(self, state: step_lib.TrainState, step: int) -> bool:
    payload = dict(self.log.counters, window=state.stats.to_numpy())
    row = self.log.last_row
    # This step's training row goes with its checkpoint: a resume writes it again if
    # metrics.jsonl lost it (`rewrite_lost_rows`).
    metrics = row if row.get('step') == step else {'last_loss': self.log.last.get('loss')}
    metrics = {k: v for k, v in metrics.items() if k != 'step' and v is not None}
    return self.ckpt.save(step, params=state.params, opt_state=state.opt_state,
                          data_iter=self.data_iter, stats=payload,
                          config=self.config.to_dict(), metrics=metrics)

  def snapshot(self, state: step_lib.TrainState, step: int) -> None:
    if self.model.config.position_embedding != 'learned':
      return
    table = sharding.to_host(model_lib.position_table(state.params))
    if self.lead:
      with outputs.atomic_write(os.path.join(self.workdir, 'tables', f'table_{step}.npy')) as f:
        np.save(f, table)

  def absorb(self, step: int, metrics: Any) -> None:
    m = {k: float(v) for k, v in jax.device_get(metrics).items()}
    if not (m['finite'] > 0 and m['loss'] <= self.divergence):
      what = 'Non-finite' if not m['finite'] > 0 else (
          f'Diverged (above divergence_loss={self.divergence:.3g})')
      raise NonFiniteLossError(
          f'{what} training loss at step {step} (loss={m["loss"]}, grad_norm='
          f'{m["grad_norm"]}). Stopped without saving; the last good checkpoint is step '
          f'{self.ckpt.latest_step()} in {self.ckpt.directory}. Lower '
          'optimizer.learning_rate, raise optimizer.warmup_steps or check the data.')
    self.log.add_step(m)
    for hook in self.hooks:
      hook(step, m)

  def evaluate(self, state: step_lib.TrainState, step: int) -> dict[str, Any]:
    from flax_posemb import evaluation  # pylint: disable=g-import-not-at-top
    from flax_posemb import eval_report  # pylint: disable=g-import-not-at-top
    out = evaluation.run_evaluation(self.model, state.params, self.config, step=step)
    res = eval_report.json_safe(out.results)
    d = self.config.data
    self.log.write_eval(step, res, out.per_position,
                        f'{d.position_policy}, {self.config.model.position_init} init, step {step}')
    return res

  def run(self, state, train_step, dropout_rng, resumed_from, preempt) -> dict[str, Any]:
    c, start = self.config, resumed_from or 0
    num_steps = int(c.num_train_steps)
    if resumed_from is None:
      self.snapshot(state, 0)
      self.save(state, 0)
    else:
      self.rewrite_lost_rows(state, start)
    result = dict(step=start, loss=None, resumed_from=resumed_from, preempted=False, eval=None)
    bar = None
    if self.lead and c.progress_bar:
      from tqdm import tqdm  # pylint: disable=g-import-not-at-top
      bar = tqdm(total=num_steps, initial=start, desc='train', dynamic_ncols=True)
    pending = None
    try:
      for step in range(start + 1, num_steps + 1):
        if step == start + 1 and preempt.requested:  # SIGTERM during setup (one host only).
          self.stopped(result, start)
          break
        batch = sharding.global_batch(next(self.data_iter), self.mesh, self.model.config.max_len)
        state, metrics = train_step(state, batch, jax.random.fold_in(dropout_rng, step))
        if pending is not None:  # Read the previous step back while this one runs.
          self.absorb(*pending)
        pending = (step, metrics)
        stop = preempt.reached(step)
        due = dict(log=step % int(c.log_every_steps) == 0 or step == num_steps,
                   eval=self.eval_due(step),
                   ckpt=stop or step % int(c.checkpoint_every_steps) == 0 or step == num_steps)
        if any(due.values()):
          self.absorb(*pending)
          pending = None
          state = self.step_end(state, step, result, due, bar)
        result['step'] = step
        if bar is not None:
          bar.update(1)
        if stop:
          self.stopped(result, step)
          break
      if pending is not None:
        self.absorb(*pending)
      self.log.write_hparams(c)
    finally:
      if bar is not None:
        bar.close()
    return result

  def rewrite_lost_rows(self, state: step_lib.TrainState, step: int) -> None:
    """Writes again the rows of the restored ``step`` that metrics.jsonl lost (a half-written
    last line, which a resume drops): the training row, stored with the checkpoint when the
    step ended a logging window, and the periodic evaluation, run again."""
    row = self.ckpt.step_metadata(step).get('metrics', {})
    # 'tokens': a whole row, stored only by a step that wrote one (`save`); older versions
    # stored only a loss.
    if self.lead and 'tokens' in row and not workdir_lib.has_row(self.workdir, step, 'loss'):
      self.log.write({'step': step, **row, 'tokens': int(row['tokens'])})
    if self.eval_due(step) and not workdir_lib.has_row(self.workdir, step, 'eval'):
      self.evaluate(state, step)

  def eval_due(self, step: int) -> bool:
    every = int(self.config.eval_every_steps)
    return every > 0 and step % every == 0

  def step_end(self, state, step, result, due, bar) -> step_lib.TrainState:
    """Log, evaluate and checkpoint after ``step`` (whatever is ``due``)."""
    if due['log']:
      result['loss'] = self.log.flush(step, state.stats)['loss']
      self.snapshot(state, step)
      state = state.replace(stats=self.zero_stats())
      if bar is not None:
        bar.set_postfix(loss=f'{result["loss"]:.4f}')
    if due['eval']:
      result['eval'] = self.evaluate(state, step)
    if due['ckpt']:
      self.save(state, step)
    return state

  def stopped(self, result: dict[str, Any], step: int) -> None:
    self.ckpt.wait_until_finished()
    if step not in self.ckpt.all_steps():
      raise RuntimeError(f'SIGTERM received at step {step}, but its checkpoint was not saved '
                         f'(see the warning above); the last checkpoint is step '
                         f'{self.ckpt.latest_step()}.')
    logging.warning('SIGTERM received: saved the checkpoint of step %d in %s; exiting.', step,
                    self.ckpt.directory)
    result['preempted'] = True
