"""The training loop, ``train_and_evaluate(config, workdir)``.

What it writes, how a run resumes and when it stops: docs/DESIGN.md § Training
outputs (the user's view: docs/training.md).
"""

from collections.abc import Callable, Sequence
import contextlib
import dataclasses
import math
import os
import time
from typing import Any, NoReturn

from absl import logging
import jax
import ml_collections
import numpy as np
import tqdm

from flax_posemb import auto as auto_lib
from flax_posemb import buckets as buckets_lib
from flax_posemb import checkpointing
from flax_posemb import config as config_lib
from flax_posemb import data as data_lib
from flax_posemb import eval_report
from flax_posemb import evaluation
from flax_posemb import init_from as init_from_lib
from flax_posemb import model as model_lib
from flax_posemb import outputs
from flax_posemb import preemption
from flax_posemb import resume
from flax_posemb import sharding
from flax_posemb import train_step as step_lib
from flax_posemb import workdir as workdir_lib
from flax_posemb.plots import evaluation as evaluation_plots
from flax_posemb.tensorboard import TensorBoard

Hook = Callable[[int, dict[str, float]], None]


class NonFiniteLossError(FloatingPointError):
  """The training loss or gradient norm became NaN/inf."""


def position_buckets(config: config_lib.RunConfig) -> np.ndarray:
  """``[nb + 1]`` edges over the position table's rows of the evaluation's
  buckets (``eval.bucket_size`` / ``eval.bucket_edges``, checked against the
  window by `config.check_across_sections`; the last bucket extended to
  ``model.max_len``): the buckets of the statistics' TensorBoard scalars."""
  return buckets_lib.make_edges(
      config.model.max_len, config.eval.bucket_size, config.eval.bucket_edges
  )


def check_periodic_eval(config: config_lib.RunConfig) -> None:
  """Now, not after a checkpoint interval of training: the data's token ids
  fit the model's vocabulary (the one check that reads the data, so not the
  config's: a config names a dataset that may be prepared later), the
  evaluation settings (the split; eval.py starts from them too) and, for
  periodic evaluation, enough documents (the batches are kept for the
  evaluations)."""
  vocab = data_lib.vocab_size(config.data)
  if vocab > config.model.vocab_size:
    raise ValueError(
        f'The data has token ids up to {vocab - 1} but model.vocab_size='
        f'{config.model.vocab_size}. Set --config.model.vocab_size={vocab}.'
    )
  settings = evaluation.eval_settings(config, {})
  if config.eval_every_steps > 0:
    evaluation.make_batches(config, settings)


def resolve_auto(
    config: config_lib.RunConfig, workdir: str
) -> config_lib.RunConfig:
  """A copy of ``config`` with its auto fields resolved (`auto.resolve_config`;
  docs/DESIGN.md § Config)."""
  saved = None
  if os.path.isdir(workdir):
    saved = workdir_lib.saved_config(workdir)
  config, resolved = auto_lib.resolve_config(config, saved=saved)
  for key, (_, value) in resolved.items():
    logging.info('%s: auto -> %r (recorded in config.json)', key, value)
  return config


def divergence_bound(config: config_lib.RunConfig) -> float:
  """Loss above which training stops as diverged: ``divergence_loss``, or three
  times the loss of a uniform guess over the vocabulary (a freshly initialized
  model starts near one)."""
  bound = config.divergence_loss
  if bound >= 0:
    return bound
  return 3.0 * math.log(config.model.vocab_size)


def train_and_evaluate(
    config: ml_collections.ConfigDict | config_lib.RunConfig,
    workdir: str,
    *,
    hooks: Sequence[Hook] = (),
) -> dict[str, Any]:
  """Trains (or resumes) a run of ``config`` (``defaults.base()`` fields, or
  their `config.RunConfig`) in ``workdir``; outputs, return value and errors:
  docs/DESIGN.md § Training outputs. ``hooks``: callables ``hook(step,
  metrics)`` run on the host once each step's metrics are read back."""
  # The one conversion (and check) of the run's ConfigDict, before JAX picks a
  # platform for the auto fields: bad input costs no backend start-up (and
  # prints no auto lines). Every module below takes the typed sections.
  if not isinstance(config, config_lib.RunConfig):
    config = init_from_lib.fill_from_own_files(config, workdir)
    config = config_lib.RunConfig.from_config_dict(config)
  # The workdir's own copies stand for what it names (a moved workdir, a
  # deleted init_from source).
  config = init_from_lib.settle_config(config, workdir)
  check_periodic_eval(config)
  config = resolve_auto(config, workdir)
  mesh = sharding.make_mesh()
  sharding.check_batch_layout(config, mesh)
  # Opened before anything is written: data that cannot be read leaves no
  # trace in the workdir.
  data_iter = data_lib.make_train_iterator(
      config.data,
      batch_size=config.batch_size,
      seed=config.seed,
      num_train_steps=config.num_train_steps,
      process_index=jax.process_index(),
      process_count=jax.process_count(),
      max_len=config.model.max_len,
  )
  dataset = data_lib.dataset_identity(config.data)
  created = not os.path.exists(workdir)
  os.makedirs(workdir, exist_ok=True)
  try:
    with contextlib.ExitStack() as stack:
      if jax.process_index() == 0:
        stack.enter_context(workdir_lib.Lock(workdir))
      # SIGTERM: the process's one handler on one host; JAX's on several
      # (SIGTERM in docs/DESIGN.md § Training outputs).
      stack.enter_context(
          preemption.defer_sigterm(install=jax.process_count() == 1)
      )
      ckpt = stack.enter_context(
          checkpointing.Checkpointer(
              checkpointing.checkpoint_dir(workdir),
              max_to_keep=config.max_to_keep,
          )
      )
      return _Loop(config, workdir, mesh, ckpt, data_iter, dataset, hooks).run()
  except Exception:
    # A refusal during setup (another writer, a checkpoint of another model)
    # leaves no trace of this call: only a workdir it created and left empty
    # is removed.
    if created:
      workdir_lib.remove_unused(workdir)
    raise


class _Loop:
  """The step loop and its outputs (rows, TensorBoard, console).

  It judges each step's loss and gradient norm (`absorb`: NaN/inf or above
  ``divergence_loss`` stops the run); ``counters`` (the training rows' running
  sums) are checkpointed as their own item.
  """

  def __init__(
      self,
      config: config_lib.RunConfig,
      workdir: str,
      mesh: Any,
      ckpt: checkpointing.Checkpointer,
      data_iter: Any,
      dataset: str | None,
      hooks: Sequence[Hook],
  ):
    self.config = config
    self.dataset = dataset
    self.workdir = workdir
    self.mesh = mesh
    self.ckpt = ckpt
    self.hooks = hooks
    self.lead = jax.process_index() == 0
    self.progress_bar = self.lead and config.progress_bar
    self.divergence = divergence_bound(config)
    # Before anything is restored or written, on every host (they read the same
    # files, so they all stop together): refuse what would lose work.
    self.resumed_from = ckpt.latest_step()
    changes = resume.check_start(
        workdir, ckpt, self.resumed_from, config, dataset
    )
    self.model = step_lib.make_model(config)
    init_rng, self.dropout_rng = jax.random.split(jax.random.key(config.seed))
    # A fresh start from another workdir's parameters (a resume has its own).
    start_params = None
    self.init_from = None
    if self.resumed_from is None and config.init_from:
      init_from_lib.check_init_from(config)
      start_params, self.init_from = init_from_lib.start_params(
          config, self.model, jax.random.fold_in(init_rng, 1)
      )
    self.state, tx, self.shardings = step_lib.init_state(
        self.model, config, mesh, init_rng, params=start_params
    )
    num_steps = config.num_train_steps
    self.data_iter = data_iter
    self.tb = None
    stats_dir = None
    if self.lead:
      self.tb = TensorBoard(
          os.path.join(workdir, outputs.TENSORBOARD_DIR),
          purge_step=(self.resumed_from or 0) + 1,
      )
      stats_dir = os.path.join(workdir, outputs.STATS_DIR)
    self.statistics = step_lib.position_statistics(
        self.model,
        config,
        log_every=config.log_every_steps,
        last_step=num_steps,
        writer=self.tb,
        directory=stats_dir,
        initial_table=self.table(self.state.params),
        bucket_edges=position_buckets(config),
        curve_image=evaluation_plots.PositionCurveImages(),
    )
    self.counters: dict[str, Any] = {
        'loss_sum': 0.0,
        'loss_steps': 0,
        'tokens': 0,
        'elapsed': 0.0,
    }
    if self.resumed_from is not None:
      self.restore()
    # The last step's metrics, the last training row, the last evaluation's
    # summary (TensorBoard's hparams metrics).
    self.last_metrics: dict[str, float] = {}
    self.last_row: dict[str, Any] = {}
    self.hparam_metrics: dict[str, Any] = {}
    # The run's start (a resume continues its elapsed time) and the current
    # logging window's start, in time and tokens.
    self.run_start = time.time() - float(self.counters['elapsed'])
    self.window_start = time.time()
    self.window_start_tokens = int(self.counters['tokens'])
    # The first window of a process also times compiling the step: its row
    # says so (`includes_compilation`).
    self.window_compiles = True
    if self.lead:
      workdir_lib.truncate_outputs(workdir, self.resumed_from or 0)
      workdir_lib.write_config(workdir, config)
      if self.init_from is not None:
        workdir_lib.write_init_record(workdir, self.init_from)
      if changes:
        self.write({'step': self.resumed_from, 'config_change': changes})
    self.train_step = step_lib.make_train_step(
        self.model, tx, config, mesh, self.shardings, self.statistics
    )

  def restore(self) -> None:
    """Continues from the latest checkpoint: state, statistics, counters."""
    # No fallback: a damaged latest step stops the run, never trained over
    # (Recovery in docs/DESIGN.md § Training outputs).
    restored = self.ckpt.restore(
        abstract_params=self.state.params,
        abstract_opt_state=self.state.opt_state,
        data_iter=self.data_iter,
        fallback=False,
    )
    self.resumed_from = int(restored['step'])
    window = self.statistics.restore(restored['stats'])
    self.state = step_lib.TrainState(
        step=jax.device_put(np.int32(self.resumed_from), self.shardings.step),
        params=restored['params'],
        opt_state=restored['opt_state'],
        stats=jax.device_put(window, self.shardings.stats),
    )
    # Checkpoints written before the counters item hold them in `stats`.
    saved_counters = restored['counters'] or restored['stats']
    for key in self.counters:
      self.counters[key] = np.asarray(saved_counters[key]).item()
    logging.info(
        'Resuming from the checkpoint of step %d in %s.',
        self.resumed_from,
        self.ckpt.directory,
    )

  def table(self, params: Any) -> np.ndarray | None:
    """The host copy of the learned position table (None without one)."""
    if self.model.config.position_embedding != 'learned':
      return None
    return sharding.to_host(model_lib.position_table(params))

  def write(self, row: dict[str, Any]) -> None:
    if self.lead:
      workdir_lib.append_row(self.workdir, row)

  def save(self, state: step_lib.TrainState, step: int) -> bool:
    # The step's training row goes with its checkpoint (`rewrite_lost_rows` may
    # need it).
    if self.last_row.get('step') == step:
      row = self.last_row
    else:
      row = {'last_loss': self.last_metrics.get('loss')}
    metrics = {k: v for k, v in row.items() if k != 'step' and v is not None}
    return self.ckpt.save(
        step,
        params=state.params,
        opt_state=state.opt_state,
        data_iter=self.data_iter,
        config=self.config.to_dict(),
        metrics=metrics,
        stats=self.statistics.state(state.stats),
        counters=self.counters,
        dataset=self.dataset,
    )

  def snapshot(
      self, state: step_lib.TrainState, step: int
  ) -> np.ndarray | None:
    """Writes ``tables/table_STEP.npy`` and returns the table (None without
    one)."""
    table = self.table(state.params)
    if self.lead and table is not None:
      with outputs.atomic_write(outputs.table_path(self.workdir, step)) as f:
        np.save(f, table)
    return table

  def absorb(self, step: int, step_metrics: Any) -> None:
    """Reads a step's metrics back and judges them: a NaN/inf or diverged loss
    stops the run before anything of the step is saved."""
    metrics = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
    if not metrics['finite'] > 0:
      what = 'Non-finite training loss'
      if math.isfinite(metrics['loss'] + metrics['grad_norm']):
        what = 'Non-finite parameter update (after a finite loss and gradient)'
      self.stop_training(step, metrics, what)
    if not metrics['loss'] <= self.divergence:
      self.stop_training(
          step,
          metrics,
          'Diverged training loss (above'
          f' divergence_loss={self.divergence:.3g})',
      )
    self.counters['loss_sum'] += metrics['loss']
    self.counters['loss_steps'] += 1
    self.counters['tokens'] += int(metrics['tokens'])
    self.last_metrics = metrics
    for hook in self.hooks:
      hook(step, metrics)

  def stop_training(
      self, step: int, metrics: dict[str, float], what: str
  ) -> NoReturn:
    raise NonFiniteLossError(
        f'{what} at step {step} (loss={metrics["loss"]},'
        f' grad_norm={metrics["grad_norm"]}). Stopped without saving; the last'
        f' good checkpoint is step {self.ckpt.latest_step()} in'
        f' {self.ckpt.directory}. Lower optimizer.learning_rate, increase'
        ' optimizer.warmup_steps or check the data.'
    )

  def flush(self, step: int) -> dict[str, Any]:
    """Writes the training row of the logging window ending at ``step``."""
    now = time.time()
    counters = self.counters
    counters['elapsed'] = now - self.run_start
    window_tokens = counters['tokens'] - self.window_start_tokens
    window_seconds = max(now - self.window_start, 1e-9)
    row = {
        'step': step,
        'loss': counters['loss_sum'] / max(counters['loss_steps'], 1),
        'last_loss': self.last_metrics.get('loss'),
        'learning_rate': self.last_metrics.get('learning_rate'),
        'grad_norm': self.last_metrics.get('grad_norm'),
        'tokens': int(counters['tokens']),
        'tokens_per_sec': window_tokens / window_seconds,
        'elapsed': counters['elapsed'],
    }
    if self.window_compiles:
      row['includes_compilation'] = True
      self.window_compiles = False
    self.write(row)
    if self.tb is not None:
      for key in ('loss', 'learning_rate', 'grad_norm', 'tokens_per_sec'):
        self.tb.add_scalar(f'train/{key}', row[key], step)
    self.last_row = row
    counters['loss_sum'] = 0.0
    counters['loss_steps'] = 0
    self.window_start = now
    self.window_start_tokens = counters['tokens']
    # The bar shows these; without it, one log line per window.
    if not self.progress_bar:
      logging.info(
          'step %d: loss %.4f, learning rate %.3g, grad norm %.3g, %.0f'
          ' tokens/s',
          step,
          row['loss'],
          row['learning_rate'] or 0.0,
          row['grad_norm'] or 0.0,
          row['tokens_per_sec'],
      )
    return row

  def evaluate(self, state: step_lib.TrainState, step: int) -> dict[str, Any]:
    """Runs the periodic evaluation: its metrics row, console line, TensorBoard
    scalars."""
    out = evaluation.run_evaluation(
        self.model, state.params, self.config, step=step
    )
    results = eval_report.json_safe(out.results)
    self.write({'step': step, 'eval': results})
    overall = results['overall']
    degradation = results['degradation']
    last_minus_best = degradation['last_minus_best']
    logging.info(
        'eval step %d: loss %.4f +- %.4f nats/token; last - best bucket %s',
        step,
        overall['loss'],
        overall['stderr'] or 0.0,
        '-' if last_minus_best is None else f'{last_minus_best:+.4f}',
    )
    self.hparam_metrics = {
        'hparam/eval_loss': overall['loss'],
        'hparam/last_minus_best': last_minus_best,
    }
    if self.tb is not None:
      scalars = {
          'eval/loss': overall['loss'],
          'eval/degradation/last_minus_best': last_minus_best,
          'eval/degradation/slope': degradation.get('slope'),
      }
      for bucket in results['buckets']:
        span = f'{bucket["start"]:05d}-{bucket["end"]:05d}'
        for key in ('loss', 'excess_loss', 'recovered'):
          scalars[f'eval_bucket_{key}/{span}'] = bucket.get(key)
      for tag, value in scalars.items():
        if value is not None:
          self.tb.add_scalar(tag, value, step)
      title = (
          f'{self.config.data.position_policy}, '
          f'{self.config.model.position_init} init, step {step}'
      )
      figure = evaluation_plots.loss_by_position_figure(
          out.per_position, results, title
      )
      self.tb.add_figure('eval/loss_by_position', figure, step)
    table = self.table(state.params)
    if table is not None:
      self.statistics.report_table(step, table)
    return results

  def run(self) -> dict[str, Any]:
    config = self.config
    state = self.state
    start = self.resumed_from or 0
    num_steps = config.num_train_steps
    if self.resumed_from is None:
      self.snapshot(state, 0)
      self.save(state, 0)
    else:
      self.rewrite_lost_rows(state, start)
    result = {
        'step': start,
        'loss': None,
        'resumed_from': self.resumed_from,
        'preempted': False,
        'eval': None,
    }
    pending = None
    with tqdm.tqdm(
        total=num_steps,
        initial=start,
        desc='train',
        dynamic_ncols=True,
        disable=not self.progress_bar,
    ) as bar:
      for step in range(start + 1, num_steps + 1):
        # A SIGTERM during setup (one host only).
        if step == start + 1 and preemption.sigterm_requested():
          self.stopped(result, start)
          break
        batch = sharding.global_batch(
            next(self.data_iter), self.mesh, self.model.config.max_len
        )
        state, metrics = self.train_step(
            state, batch, jax.random.fold_in(self.dropout_rng, step)
        )
        # Read the previous step back while this one runs.
        if pending is not None:
          self.absorb(*pending)
        pending = (step, metrics)
        stop = self.preemption_reached(step)
        log_due = self.statistics.window_ends(step)
        eval_due = self.eval_due(step)
        checkpoint_due = (
            stop
            or step % config.checkpoint_every_steps == 0
            or step == num_steps
        )
        # Log, evaluate and checkpoint after the step.
        if log_due or eval_due or checkpoint_due:
          self.absorb(*pending)
          pending = None
        if log_due:
          state = self.end_window(state, step)
          result['loss'] = self.flush(step)['loss']
          bar.set_postfix(loss=f'{result["loss"]:.4f}')
        if eval_due:
          result['eval'] = self.evaluate(state, step)
        if checkpoint_due:
          self.save(state, step)
        result['step'] = step
        bar.update(1)
        if stop:
          self.stopped(result, step)
          break
      if pending is not None:
        self.absorb(*pending)
      self.write_hparams()
    return result

  def end_window(
      self, state: step_lib.TrainState, step: int
  ) -> step_lib.TrainState:
    """Ends the statistics window at ``step`` (window file, table snapshot,
    TensorBoard curves); the state continues with an empty window."""
    table = self.snapshot(state, step)
    window = self.statistics.on_step(step, state.stats, table=table)
    return dataclasses.replace(
        state, stats=jax.device_put(window, self.shardings.stats)
    )

  def write_hparams(self) -> None:
    """The config as hparams, the last evaluation's losses as metrics."""
    if self.tb is None:
      return
    hparams = {}
    for key, value in workdir_lib.flat_config(self.config).items():
      if not isinstance(value, (int, float, str, bool)):
        value = str(value)
      hparams[key] = value
    metrics = {k: v for k, v in self.hparam_metrics.items() if v is not None}
    self.tb.add_hparams(hparams, metrics)

  def rewrite_lost_rows(self, state: step_lib.TrainState, step: int) -> None:
    """Writes again the restored ``step``'s rows that metrics.jsonl lost
    (Resume in docs/DESIGN.md § Training outputs)."""
    # The row saved with the checkpoint; whole only if it has 'tokens'.
    row = self.ckpt.step_metadata(step).get('metrics', {})
    if self.lead and 'tokens' in row:
      if not workdir_lib.has_row(self.workdir, step, 'loss'):
        self.write({'step': step, **row, 'tokens': int(row['tokens'])})
    if self.eval_due(step) and not workdir_lib.has_row(
        self.workdir, step, 'eval'
    ):
      self.evaluate(state, step)

  def eval_due(self, step: int) -> bool:
    """Whether ``step`` has a periodic evaluation (never step 0: an
    uninterrupted run does not evaluate before training)."""
    every = self.config.eval_every_steps
    return every > 0 and step > 0 and step % every == 0

  def preemption_reached(self, step: int) -> bool:
    """Whether to save and stop after ``step``: a SIGTERM on one host; on
    several, Orbax's `reached_preemption` (JAX's notifier), so that every host
    stops at the same step."""
    if jax.process_count() > 1:
      return self.ckpt.reached_preemption(step)
    return preemption.sigterm_requested()

  def stopped(self, result: dict[str, Any], step: int) -> None:
    self.ckpt.wait_until_finished()
    if step not in self.ckpt.all_steps():
      raise RuntimeError(
          f'SIGTERM received at step {step}, but its checkpoint was not saved '
          '(see the warning above); the last checkpoint is step '
          f'{self.ckpt.latest_step()}.'
      )
    logging.warning(
        'SIGTERM received: saved the checkpoint of step %d in %s; exiting.',
        step,
        self.ckpt.directory,
    )
    result['preempted'] = True
