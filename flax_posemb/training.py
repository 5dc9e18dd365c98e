"""The training loop, ``train_and_evaluate(config, workdir)``.

What it writes, how a run resumes and when it stops: docs/DESIGN.md §Training
outputs (the user's view: the README).
"""

from collections.abc import Callable, Sequence
import contextlib
import math
import os
import time
from typing import Any

from absl import logging
import jax
import ml_collections
import numpy as np
import tqdm

from flax_posemb import auto as auto_lib
from flax_posemb import checkpointing
from flax_posemb import cli
from flax_posemb import data as data_lib
from flax_posemb import model as model_lib
from flax_posemb import optim as optim_lib
from flax_posemb import outputs
from flax_posemb import sharding
from flax_posemb import train_step as step_lib
from flax_posemb import workdir as workdir_lib
from flax_posemb.tensorboard import TensorBoard

Hook = Callable[[int, dict[str, float]], None]


class NonFiniteLossError(FloatingPointError):
  """The training loss or gradient norm became NaN/inf."""


def validate(config: ml_collections.ConfigDict) -> None:
  """Checks the config, periodic evaluation included, before anything is
  built."""
  for key in (
      'num_train_steps',
      'log_every_steps',
      'checkpoint_every_steps',
      'batch_size',
      'max_to_keep',
  ):
    if int(config[key]) < 1:
      raise ValueError(f'{key} must be >= 1, got {config[key]}.')
  mcfg = model_lib.ModelConfig.from_config(config.model)
  data_lib.validate_config(config.data, max_len=mcfg.max_len)
  vocab = data_lib.vocab_size(config.data)
  if vocab > mcfg.vocab_size:
    raise ValueError(
        f'The data has token ids up to {vocab - 1} but model.vocab_size='
        f'{mcfg.vocab_size}. Set --config.model.vocab_size={vocab}.'
    )
  if not math.isfinite(float(config.divergence_loss)):
    raise ValueError(
        f'divergence_loss must be finite, got {config.divergence_loss}.'
    )
  optim_lib.validate(config)
  # Now, not after a checkpoint interval of training.
  if int(config.eval_every_steps) > 0:
    from flax_posemb import buckets as buckets_lib
    from flax_posemb import evaluation
    # checks window_len and the deep-window limits
    s = evaluation.eval_settings(config, {})
    try:
      buckets_lib.make_edges(
          int(s['window_len']), int(s['bucket_size']), s['bucket_edges']
      )
    except ValueError as e:
      raise ValueError(f'eval.bucket_size / eval.bucket_edges: {e}') from None
    for key in ('num_windows', 'batch_size'):
      if int(s[key]) < 1:
        raise ValueError(f'eval.{key} must be >= 1, got {s[key]}.')
    # Too few documents fail here; kept for the evaluations.
    evaluation.make_batches(config, s)


def resolve_auto(
    config: ml_collections.ConfigDict, workdir: str
) -> ml_collections.ConfigDict:
  """A copy of ``config`` with its auto fields resolved (`auto.resolve_config`;
  DESIGN §Config)."""
  config = config.copy_and_resolve_references()
  saved = workdir_lib.saved_config(workdir) if os.path.isdir(workdir) else None
  for key, (_, value) in auto_lib.resolve_config(config, saved=saved).items():
    logging.info('%s: auto -> %r (recorded in config.json)', key, value)
  return config


def divergence_bound(config: ml_collections.ConfigDict) -> float:
  """Loss above which training stops as diverged: ``divergence_loss``, or three
  times the loss of a uniform guess over the vocabulary (a freshly initialized
  model starts near one)."""
  bound = float(config.divergence_loss)
  return bound if bound >= 0 else 3.0 * math.log(int(config.model.vocab_size))


def train_and_evaluate(
    config: ml_collections.ConfigDict,
    workdir: str,
    *,
    hooks: Sequence[Hook] = (),
) -> dict[str, Any]:
  """Trains (or resumes) a run of ``config`` (``defaults.base()`` fields) in
  ``workdir``; outputs, return value and errors: docs/DESIGN.md §Training
  outputs. ``hooks``: callables ``hook(step, metrics)`` run on the host once
  each step's metrics are read back."""
  config = resolve_auto(config, workdir)
  validate(config)
  mesh = sharding.make_mesh()
  sharding.check_batch_layout(config, mesh)
  os.makedirs(workdir, exist_ok=True)
  # SIGTERM: the process's one handler on one host; JAX's on several (DESIGN.md
  # "SIGTERM").
  with (
      workdir_lib.Lock(workdir)
      if jax.process_index() == 0
      else contextlib.nullcontext(),
      cli.defer_sigterm(install=jax.process_count() == 1),
      checkpointing.Checkpointer(
          checkpointing.checkpoint_dir(workdir),
          max_to_keep=int(config.max_to_keep),
      ) as ckpt,
  ):
    return _Loop(config, workdir, mesh, ckpt, hooks).run()


class _Loop:
  """The step loop and its outputs (rows, TensorBoard, console); ``counters``
  are checkpointed."""

  def __init__(
      self,
      config: ml_collections.ConfigDict,
      workdir: str,
      mesh: Any,
      ckpt: checkpointing.Checkpointer,
      hooks: Sequence[Hook],
  ):
    self.config, self.workdir, self.mesh, self.ckpt, self.hooks = (
        config,
        workdir,
        mesh,
        ckpt,
        hooks,
    )
    self.lead = jax.process_index() == 0
    self.progress_bar = self.lead and bool(config.progress_bar)
    self.divergence = divergence_bound(config)
    # Before anything is restored or written, on every host (they read the same
    # files, so they all stop together): refuse what would lose work.
    self.resumed_from, changes = ckpt.latest_step(), {}
    if self.resumed_from is None:
      workdir_lib.check_fresh_start(workdir)
    else:
      changes = workdir_lib.check_resume_config(
          workdir, config, ckpt.latest_config()
      )
    self.model = model = step_lib.make_model(config)
    init_rng, self.dropout_rng = jax.random.split(
        jax.random.key(int(config.seed))
    )
    self.state, tx, self.shardings = step_lib.init_state(
        model, config, mesh, init_rng
    )
    num_steps = int(config.num_train_steps)
    self.data_iter = data_lib.make_train_iterator(
        config.data,
        batch_size=int(config.batch_size),
        seed=int(config.seed),
        num_train_steps=num_steps,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        max_len=model.config.max_len,
    )
    self.tb = (
        TensorBoard(
            os.path.join(workdir, 'tensorboard'), (self.resumed_from or 0) + 1
        )
        if self.lead
        else None
    )
    self.statistics = step_lib.position_statistics(
        model,
        config,
        log_every=int(config.log_every_steps),
        last_step=num_steps,
        writer=self.tb,
        directory=os.path.join(workdir, 'stats') if self.lead else None,
        initial_table=self.table(self.state.params),
    )
    self.counters = dict(loss_sum=0.0, loss_steps=0, tokens=0, elapsed=0.0)
    if self.resumed_from is not None:
      # No fallback: a damaged latest step stops the run, never trained over
      # (DESIGN §Recovery).
      r = ckpt.restore(
          abstract_params=self.state.params,
          abstract_opt_state=self.state.opt_state,
          data_iter=self.data_iter,
          fallback=False,
      )
      self.resumed_from = int(r['step'])
      self.state = step_lib.TrainState(
          step=jax.device_put(np.int32(self.resumed_from), self.shardings.step),
          params=r['params'],
          opt_state=r['opt_state'],
          stats=jax.device_put(
              self.statistics.restore(r['stats']), self.shardings.stats
          ),
      )
      self.counters = {
          k: np.asarray(r['stats'][k]).item() for k in self.counters
      }
      logging.info(
          'Resuming from the checkpoint of step %d in %s.',
          self.resumed_from,
          ckpt.directory,
      )
    # step's, window's, eval's
    self.last, self.last_row, self.hparam_metrics = {}, {}, {}
    self._t0 = time.time() - float(self.counters['elapsed'])  # the run's start
    # time, tokens at its start
    self._window = (time.time(), int(self.counters['tokens']))
    if self.lead:
      workdir_lib.truncate_outputs(workdir, self.resumed_from or 0)
      workdir_lib.write_config(workdir, config)
      if changes:
        self.write({'step': self.resumed_from, 'config_change': changes})
    self.train_step = step_lib.make_train_step(
        model, tx, config, mesh, self.shardings, self.statistics
    )

  def table(self, params: Any) -> np.ndarray | None:
    """The host copy of the learned position table (None without one)."""
    learned = self.model.config.position_embedding == 'learned'
    return (
        sharding.to_host(model_lib.position_table(params)) if learned else None
    )

  def write(self, row: dict[str, Any]) -> None:
    if self.lead:
      workdir_lib.append_row(self.workdir, row)

  def save(self, state: step_lib.TrainState, step: int) -> bool:
    # The step's training row goes with its checkpoint (`rewrite_lost_rows` may
    # need it).
    row = self.last_row
    metrics = (
        row if row.get('step') == step else {'last_loss': self.last.get('loss')}
    )
    metrics = {
        k: v for k, v in metrics.items() if k != 'step' and v is not None
    }
    return self.ckpt.save(
        step,
        params=state.params,
        opt_state=state.opt_state,
        data_iter=self.data_iter,
        config=self.config.to_dict(),
        metrics=metrics,
        stats=dict(self.statistics.state(state.stats), **self.counters),
    )

  def snapshot(
      self, state: step_lib.TrainState, step: int
  ) -> np.ndarray | None:
    """Writes ``tables/table_STEP.npy`` and returns the table (None without
    one)."""
    table = self.table(state.params)
    if self.lead and table is not None:
      with outputs.atomic_write(
          os.path.join(self.workdir, 'tables', f'table_{step}.npy')
      ) as f:
        np.save(f, table)
    return table

  def absorb(self, step: int, metrics: Any) -> None:
    m = {k: float(v) for k, v in jax.device_get(metrics).items()}
    if not (m['finite'] > 0 and m['loss'] <= self.divergence):
      what = (
          'Non-finite'
          if not m['finite'] > 0
          else (f'Diverged (above divergence_loss={self.divergence:.3g})')
      )
      raise NonFiniteLossError(
          f'{what} training loss at step {step} (loss={m["loss"]},'
          f' grad_norm={m["grad_norm"]}). Stopped without saving; the last good'
          f' checkpoint is step {self.ckpt.latest_step()} in'
          f' {self.ckpt.directory}. Lower optimizer.learning_rate, increase'
          ' optimizer.warmup_steps or check the data.'
      )
    self.counters['loss_sum'] += m['loss']
    self.counters['loss_steps'] += 1
    self.counters['tokens'] += int(m['tokens'])
    self.last = m
    for hook in self.hooks:
      hook(step, m)

  def flush(self, step: int) -> dict[str, Any]:
    """Writes the training row of the logging window ending at ``step``."""
    c, now = self.counters, time.time()
    c['elapsed'] = now - self._t0
    row = dict(
        step=step,
        loss=c['loss_sum'] / max(c['loss_steps'], 1),
        last_loss=self.last.get('loss'),
        learning_rate=self.last.get('learning_rate'),
        grad_norm=self.last.get('grad_norm'),
        tokens=int(c['tokens']),
        tokens_per_sec=(c['tokens'] - self._window[1])
        / max(now - self._window[0], 1e-9),
        elapsed=c['elapsed'],
    )
    self.write(row)
    if self.tb is not None:
      for k in ('loss', 'learning_rate', 'grad_norm', 'tokens_per_sec'):
        self.tb.add_scalar(f'train/{k}', row[k], step)
    self.last_row = row
    c.update(loss_sum=0.0, loss_steps=0)
    self._window = (now, c['tokens'])
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
    from flax_posemb import eval_report
    from flax_posemb import evaluation

    out = evaluation.run_evaluation(
        self.model, state.params, self.config, step=step
    )
    res = eval_report.json_safe(out.results)
    self.write(dict(step=step, eval=res))
    o, d = res['overall'], res['degradation']
    lmb = d['last_minus_best']
    logging.info(
        'eval step %d: loss %.4f +- %.4f nats/token; last - best bucket %s',
        step,
        o['loss'],
        o['stderr'] or 0.0,
        '-' if lmb is None else f'{lmb:+.4f}',
    )
    self.hparam_metrics = {
        'hparam/eval_loss': o['loss'],
        'hparam/last_minus_best': lmb,
    }
    if self.tb is not None:
      scalars = {
          'eval/loss': o['loss'],
          'eval/degradation/last_minus_best': lmb,
          'eval/degradation/slope': d.get('slope'),
      }
      scalars.update(
          {
              f'eval_bucket_{k}/{b["start"]:05d}-{b["end"]:05d}': b.get(k)
              for b in res['buckets']
              for k in ('loss', 'excess_loss', 'recovered')
          }
      )
      for tag, value in scalars.items():
        if value is not None:
          self.tb.add_scalar(tag, value, step)
      from flax_posemb import plots  # matplotlib

      self.tb.add_figure(
          'eval/loss_by_position',
          plots.loss_by_position_figure(
              out.per_position,
              res,
              f'{self.config.data.position_policy}, '
              f'{self.config.model.position_init} init, step {step}',
          ),
          step,
      )
    if (table := self.table(state.params)) is not None:
      self.statistics.report_table(step, table)
    return res

  def run(self) -> dict[str, Any]:
    c, state, resumed_from = self.config, self.state, self.resumed_from
    start, num_steps = resumed_from or 0, int(c.num_train_steps)
    if resumed_from is None:
      self.snapshot(state, 0)
      self.save(state, 0)
    else:
      self.rewrite_lost_rows(state, start)
    result = dict(
        step=start,
        loss=None,
        resumed_from=resumed_from,
        preempted=False,
        eval=None,
    )
    pending = None
    with tqdm.tqdm(
        total=num_steps,
        initial=start,
        desc='train',
        dynamic_ncols=True,
        disable=not self.progress_bar,
    ) as bar:
      for step in range(start + 1, num_steps + 1):
        # During setup (one host only).
        if step == start + 1 and cli.sigterm_requested():
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
        stop = (
            self.ckpt.reached_preemption(step)
            if jax.process_count() > 1
            else cli.sigterm_requested()
        )
        due = dict(
            log=self.statistics.window_ends(step),
            eval=self.eval_due(step),
            ckpt=stop
            or step % int(c.checkpoint_every_steps) == 0
            or step == num_steps,
        )
        if any(due.values()):  # Log, evaluate and checkpoint after the step.
          self.absorb(*pending)
          pending = None
        if due['log']:
          window = self.statistics.on_step(
              step, state.stats, table=self.snapshot(state, step)
          )
          state = state.replace(
              stats=jax.device_put(window, self.shardings.stats)
          )
          result['loss'] = self.flush(step)['loss']
          bar.set_postfix(loss=f'{result["loss"]:.4f}')
        if due['eval']:
          result['eval'] = self.evaluate(state, step)
        if due['ckpt']:
          self.save(state, step)
        result['step'] = step
        bar.update(1)
        if stop:
          self.stopped(result, step)
          break
      if pending is not None:
        self.absorb(*pending)
      # The config as hparams, the last evaluation's losses as metrics.
      if self.tb is not None:
        hparams = {
            k: v if isinstance(v, (int, float, str, bool)) else str(v)
            for k, v in workdir_lib.flat_config(c).items()
        }
        self.tb.add_hparams(
            hparams,
            {k: v for k, v in self.hparam_metrics.items() if v is not None},
        )
    return result

  def rewrite_lost_rows(self, state: step_lib.TrainState, step: int) -> None:
    """Writes again the restored ``step``'s rows that metrics.jsonl lost
    (DESIGN.md §Resume)."""
    # whole only if it has 'tokens'
    row = self.ckpt.step_metadata(step).get('metrics', {})
    if (
        self.lead
        and 'tokens' in row
        and not workdir_lib.has_row(self.workdir, step, 'loss')
    ):
      self.write({'step': step, **row, 'tokens': int(row['tokens'])})
    if self.eval_due(step) and not workdir_lib.has_row(
        self.workdir, step, 'eval'
    ):
      self.evaluate(state, step)

  def eval_due(self, step: int) -> bool:
    return (
        self.config.eval_every_steps > 0
        and step % self.config.eval_every_steps == 0
    )

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
