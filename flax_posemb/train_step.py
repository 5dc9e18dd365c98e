"""Train state and jitted step; loss and update are bit-identical with
statistics on or off."""

from __future__ import annotations

from collections.abc import Callable, Mapping
import dataclasses
from typing import TYPE_CHECKING, Any

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import optax

from flax_posemb import auto
from flax_posemb import model as model_lib
from flax_posemb import optim
from flax_posemb import sharding
from flax_posemb import stats as stats_lib

# Type hints only: the step runs without Grain or ml_collections (the device
# image), which the config's checks import.
if TYPE_CHECKING:
  from flax_posemb import config as config_lib

PyTree = Any


@flax.struct.dataclass
class TrainState:
  """Everything the step updates: ``step`` (int32 scalar, optimizer steps done),
  ``params``, ``opt_state`` and ``stats``, the statistics window
  (``PositionStatistics.init``). ``init_state`` also gives one of their
  shardings (for jit and restoring)."""

  step: jax.Array | jax.sharding.Sharding
  params: PyTree
  opt_state: PyTree
  stats: stats_lib.PositionStats


def token_losses(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Float32 cross entropy ``[B, T]`` of int ``targets`` ``[B, T]``, ``logits``
  ``[B, T, V]``."""
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), targets
  )


def make_model(config: config_lib.RunConfig) -> model_lib.TransformerLM:
  """The ``TransformerLM`` of ``config.model``."""
  return model_lib.TransformerLM(config.model)


def stored_model_fields(config: Mapping[str, Any]) -> dict[str, Any]:
  """The model section of a config read back (``config.json``, a
  checkpoint's), for its stored parameters: a ``file:`` table is not read again
  (it may have moved; the checkpoint holds the table), and cuDNN attention, a
  platform's choice, becomes 'auto'."""
  model = dict(config['model'])
  if str(model.get('position_init', '')).startswith('file:'):
    model['position_init'] = 'zeros'
  if model.get('attention_impl') == 'cudnn':
    model['attention_impl'] = 'auto'
  return model


def stored_model(config: Mapping[str, Any]) -> model_lib.TransformerLM:
  """The ``TransformerLM`` of a config read back, for its stored parameters
  (`stored_model_fields`)."""
  model = stored_model_fields(config)
  return model_lib.TransformerLM(model_lib.ModelConfig.from_config(model))


def position_statistics(
    model: model_lib.TransformerLM, config: config_lib.RunConfig, **kwargs
) -> stats_lib.PositionStatistics:
  """The statistics object of ``model``'s table, ``config.collect_stats`` and
  host ``kwargs``."""
  return stats_lib.PositionStatistics(
      model.config.max_len,
      model.config.emb_dim,
      collect=config.collect_stats,
      **kwargs,
  )


def init_state(
    model: model_lib.TransformerLM,
    config: config_lib.RunConfig,
    mesh: Mesh,
    rng: jax.Array,
    params: PyTree | None = None,
) -> tuple[TrainState, optax.GradientTransformation, TrainState]:
  """``(state, tx, state_shardings)``: the initial state on ``mesh`` (axis
  ``'data'``) from PRNG key ``rng`` (or of ``params``, host arrays of the
  model's tree: config init_from), the optimizer, and the state's shardings
  (for jit and restoring)."""
  seq = config.data.seq_len
  dummy = jnp.zeros((1, seq), jnp.int32)

  def init_params(key):
    return model.init(
        key,
        dummy,
        jnp.arange(seq, dtype=jnp.int32)[None],
        segment_ids=dummy + 1,
    )['params']

  abstract = jax.eval_shape(init_params, rng)
  p_sh = sharding.tree_shardings(abstract, mesh, config.fsdp)
  tx = optim.make_optimizer(config, abstract)
  o_sh = sharding.tree_shardings(
      jax.eval_shape(tx.init, abstract), mesh, config.fsdp
  )
  stats = position_statistics(model, config).init()
  repl = sharding.replicated(mesh)
  shardings = TrainState(
      step=repl,
      params=p_sh,
      opt_state=o_sh,
      stats=jax.tree.map(lambda _: repl, stats),
  )
  if params is None:
    params = jax.jit(init_params, out_shardings=p_sh)(rng)
  else:
    params = jax.device_put(params, p_sh)
  state = TrainState(
      step=jnp.zeros((), jnp.int32),
      params=params,
      opt_state=jax.jit(tx.init, out_shardings=o_sh)(params),
      stats=stats,
  )
  return jax.device_put(state, shardings), tx, shardings


def accumulated(
    value_and_grad: Callable[..., tuple], accum: int, mesh: Mesh
) -> Callable[..., tuple]:
  """``f(params, batch, rng, denom) -> (loss, grads, stats)``:
  ``value_and_grad`` (with ``finish=False``) summed over ``accum`` microbatches
  (row ``i`` in microbatch ``i % accum``, each split over the mesh's ``'data'``
  axis), gradients in float32, statistics unfinished."""
  micro_sh = NamedSharding(mesh, P(None, 'data'))

  def one(params, mb, key, denom):
    loss, grads, st = value_and_grad(params, mb, key, denominator=denom)
    return loss, jax.tree.map(lambda g: g.astype(jnp.float32), grads), st

  def f(params, batch, rng, denom):
    if accum == 1:
      return value_and_grad(
          params, batch, jax.random.fold_in(rng, 0), denominator=denom
      )
    b = batch['inputs'].shape[0]
    micro = jax.tree.map(
        lambda x: jax.lax.with_sharding_constraint(
            x.reshape((b // accum, accum) + x.shape[1:]).swapaxes(0, 1),
            micro_sh,
        ),
        batch,
    )

    def body(carry, xs):
      i, mb = xs
      out = one(params, mb, jax.random.fold_in(rng, i), denom)
      return jax.tree.map(jnp.add, carry, out), None

    shapes = jax.eval_shape(
        one, params, jax.tree.map(lambda x: x[0], micro), rng, denom
    )
    zero = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    return jax.lax.scan(body, zero, (jnp.arange(accum), micro))[0]

  return f


def make_train_step(
    model: model_lib.TransformerLM,
    tx: optax.GradientTransformation,
    config: config_lib.RunConfig,
    mesh: Mesh,
    state_shardings: TrainState,
    statistics: stats_lib.PositionStatistics | None = None,
) -> Callable[[TrainState, dict, jax.Array], tuple[TrainState, dict]]:
  """The jitted step ``(state, batch, rng) -> (state, metrics)`` (state donated)
  of global ``[B, T]`` ``batch`` arrays, dropout key ``rng``; ``tx``,
  ``state_shardings``: ``init_state``'s; ``statistics``: the loop's (default
  ``position_statistics``). ``metrics``: float32 ``loss`` (mean over scored
  targets), ``grad_norm`` (before clipping), ``learning_rate``, ``tokens``,
  ``targets`` and ``finite`` (1.0 if the loss, the gradient norm and the
  update are)."""
  # Training resolves 0 (auto) at startup and records it; direct callers get the
  # same rule.
  accum = auto.grad_accum_steps(
      config.grad_accum_steps,
      platform=jax.default_backend(),
      batch_size=config.batch_size,
      seq_len=config.data.seq_len,
      num_devices=mesh.size,
  )
  statistics = statistics or position_statistics(model, config)
  deterministic = model.config.dropout_rate == 0.0

  # [B, T] losses; `key`: dropout's
  def token_loss_fn(params, embed_delta, batch, key):
    logits = model.apply(
        {'params': params},
        batch['inputs'],
        batch['positions'],
        segment_ids=batch['segment_ids'],
        deterministic=deterministic,
        embed_delta=embed_delta,
        rngs={'dropout': key},
    )
    return token_losses(logits, batch['targets'])

  gradients = accumulated(
      # Batches are checked where they cross to the device
      # (sharding.global_batch), the one owner of the position range here; the
      # model adds embed_delta (tests/test_model.py), so no run-time check of
      # its gradient either.
      statistics.value_and_grad(
          token_loss_fn,
          finish=False,
          check_positions=False,
          check_signal=False,
      ),
      accum,
      mesh,
  )
  schedule = optim.make_schedule(config)
  row_scale = config.optimizer.row_lr_scale

  def step_fn(state, batch, rng):
    n_targets = jnp.sum(batch['loss_mask'].astype(jnp.float32))
    loss, grads, step_stats = gradients(
        state.params, batch, rng, jnp.maximum(n_targets, 1.0)
    )
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
    extra = (
        {'position_counts': step_stats['count'].astype(jnp.float32)}
        if row_scale
        else {}
    )
    updates, opt = tx.update(grads, state.opt_state, state.params, **extra)
    params = optax.apply_updates(state.params, updates)
    tables = (
        (
            model_lib.position_table(state.params),
            model_lib.position_table(params),
        )
        if model.config.position_embedding == 'learned'
        else ()
    )
    window = statistics.inside_step(state.stats, step_stats, *tables)
    grad_norm = optax.tree.norm(grads)
    # Finite loss and gradients can still give a non-finite update (Adam with
    # eps=0 on an unseen row): the loop stops on any of the three, the one
    # owner of finiteness (nothing non-finite is ever saved).
    update_finite = jnp.array(
        [jnp.isfinite(u).all() for u in jax.tree.leaves(updates)]
    ).all()
    metrics = dict(
        loss=loss,
        grad_norm=grad_norm,
        targets=n_targets,
        learning_rate=jnp.asarray(schedule(state.step), jnp.float32),
        tokens=jnp.sum((batch['segment_ids'] > 0).astype(jnp.float32)),
        finite=(
            jnp.isfinite(loss) & jnp.isfinite(grad_norm) & update_finite
        ).astype(jnp.float32),
    )
    new_state = dataclasses.replace(
        state, step=state.step + 1, params=params, opt_state=opt, stats=window
    )
    return new_state, metrics

  repl = sharding.replicated(mesh)
  return jax.jit(
      step_fn,
      in_shardings=(state_shardings, sharding.batch_sharding(mesh), repl),
      out_shardings=(state_shardings, repl),
      donate_argnums=(0,),
  )
