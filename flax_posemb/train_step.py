"""The train state, the jitted train step with per-position statistics, and sharding (used by `training`).

One compiled step (``make_train_step``) takes ``(state, batch, rng)`` and returns the new
state and a metrics dict. It differentiates the optimizer loss (the mean token loss over
the ``loss_mask`` targets of the whole global batch) with respect to ``params`` and the
model's ``perturbations['embed_sum']`` in **one** backward pass. The perturbation gradient
is the gradient of the mean loss; multiplied by the step's number of scored targets ``N``
it is ``g(b, t)``, the gradient of the **sum-reduced** loss that ``flax_posemb.stats``
documents. Under gradient accumulation the batch is cut into ``grad_accum_steps``
microbatches (row ``i`` goes to microbatch ``i % grad_accum_steps``), each microbatch loss is
divided by the *global* ``N``, and gradients and per-position sums are added over
microbatches; ``row_sq`` squares the per-row sum of ``g`` over the whole step.

Statistics are accumulated on device in ``TrainState.window`` (a dict of ``[max_len]``
vectors, see ``stats.FIELDS``) until the loop writes and resets it at each log step.
With ``collect_stats=False`` only ``loss_sum``/``loss_count`` are accumulated (no gradient
statistics); the loss and the update are bit-identical either way (tested on CPU, with and
without accumulation): both modes take the same joint gradient (the ``embed_sum``
cotangent is an intermediate of the backward pass anyway) and read the token losses the
same way, so XLA compiles the loss and the update identically. Without this care XLA fuses
the loss reduction differently and the loss differs in the last bit.

Sharding: a 1-D ``jax.sharding.Mesh`` with axis ``'data'`` over all devices (all hosts);
the batch is sharded along it, parameters are replicated, or with ``fsdp=True`` matrices
with at least ``FSDP_MIN_SIZE`` elements are sharded along their largest divisible axis
(the Adam moments follow). XLA inserts the cross-device reductions, so the statistics are
global-batch figures on any number of devices.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from flax_posemb import embeddings
from flax_posemb import model as model_lib
from flax_posemb import optim
from flax_posemb import stats as stats_lib

BATCH_KEYS = ('inputs', 'targets', 'positions', 'segment_ids', 'loss_mask')
FSDP_MIN_SIZE = 2 ** 14  # Matrices with at least this many elements are sharded under fsdp.

PyTree = Any


@flax.struct.dataclass
class TrainState:
  """Everything the step updates.

  Attributes:
    step: int32 scalar, optimizer steps done.
    params: model parameters.
    opt_state: optax state.
    window: per-position statistics summed since the last log step (``stats.FIELDS`` ->
      ``[max_len]``; only ``stats.LOSS_FIELDS`` when statistics are off).
  """
  step: jax.Array
  params: PyTree
  opt_state: PyTree
  window: dict[str, jax.Array]


def make_mesh(devices: Any = None) -> Mesh:
  """1-D mesh with axis ``'data'`` over ``devices`` (default: all devices of all hosts)."""
  devices = jax.devices() if devices is None else list(devices)
  return Mesh(np.asarray(devices), ('data',))


def param_sharding(shape: tuple[int, ...], mesh: Mesh, fsdp: bool) -> NamedSharding:
  """Sharding of one parameter (or optimizer moment) of ``shape``.

  Args:
    shape: array shape.
    mesh: mesh with axis ``'data'``.
    fsdp: shard large matrices along their largest axis divisible by the device count.

  Returns:
    A ``NamedSharding`` (replicated unless fsdp applies).
  """
  n = mesh.shape['data']
  if fsdp and n > 1 and len(shape) >= 2 and int(np.prod(shape)) >= FSDP_MIN_SIZE:
    for axis in sorted(range(len(shape)), key=lambda a: -shape[a]):
      if shape[axis] % n == 0:
        spec = [None] * len(shape)
        spec[axis] = 'data'
        return NamedSharding(mesh, P(*spec))
  return NamedSharding(mesh, P())


def tree_shardings(tree: PyTree, mesh: Mesh, fsdp: bool) -> PyTree:
  """``param_sharding`` for every leaf of a tree of arrays / ShapeDtypeStructs."""
  return jax.tree.map(lambda x: param_sharding(tuple(x.shape), mesh, fsdp), tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Sharding of ``[B, T]`` batch arrays: rows over ``'data'``."""
  return NamedSharding(mesh, P('data'))


def check_batch_layout(config: ml_collections.ConfigDict, mesh: Mesh) -> None:
  """Raises a clear ValueError if the batch cannot be split over devices/microbatches."""
  b, a, n = int(config.batch_size), int(config.grad_accum_steps), mesh.size
  if a < 1:
    raise ValueError(f'grad_accum_steps must be >= 1, got {a}.')
  if b < 1 or b % (a * n):
    raise ValueError(
        f'batch_size={b} must be a positive multiple of grad_accum_steps * device count = '
        f'{a} * {n} = {a * n} (each microbatch is split evenly over the devices). Set '
        f'--config.batch_size to a multiple of {a * n}.')
  if b % jax.process_count():
    raise ValueError(f'batch_size={b} must be divisible by the process count '
                     f'{jax.process_count()}.')


def token_losses(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Float32 cross entropy ``[B, T]`` of integer ``targets`` ``[B, T]`` under ``logits`` ``[B, T, V]``."""
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)


def zero_window(max_len: int, collect_stats: bool) -> dict[str, jax.Array]:
  """Empty window accumulators: all ``stats.FIELDS``, or only ``stats.LOSS_FIELDS`` when
  statistics are off (loss by position is always kept)."""
  fields = stats_lib.FIELDS if collect_stats else stats_lib.LOSS_FIELDS
  return {k: v for k, v in stats_lib.zeros(max_len).items() if k in fields}


def make_model(config: ml_collections.ConfigDict) -> model_lib.TransformerLM:
  """The ``TransformerLM`` of ``config.model`` (unknown keys are an error)."""
  return model_lib.TransformerLM(model_lib.ModelConfig.from_config(config.model))


def _has_table(model: model_lib.TransformerLM) -> bool:
  return model.config.position_embedding == 'learned'


def init_state(model: model_lib.TransformerLM, config: ml_collections.ConfigDict,
               mesh: Mesh, rng: jax.Array
               ) -> tuple[TrainState, optax.GradientTransformation, Any]:
  """Initial sharded state.

  Args:
    model: the model.
    config: full config.
    mesh: mesh with axis ``'data'``.
    rng: PRNG key for parameter init.

  Returns:
    ``(state, tx, state_shardings)``: the state, the optimizer and a ``TrainState`` of
    shardings (for jit and for restoring checkpoints onto this mesh).
  """
  seq = int(config.data.seq_len)
  dummy = jnp.zeros((1, seq), jnp.int32)

  def init_params(key):
    return model.init(key, dummy, jnp.arange(seq, dtype=jnp.int32)[None],
                      segment_ids=dummy + 1)['params']

  abstract = jax.eval_shape(init_params, rng)
  p_sh = tree_shardings(abstract, mesh, config.fsdp)
  tx = optim.make_optimizer(config, abstract)
  abstract_opt = jax.eval_shape(tx.init, abstract)
  o_sh = tree_shardings(abstract_opt, mesh, config.fsdp)
  max_len = model.config.max_len
  window = zero_window(max_len, config.collect_stats)
  repl = NamedSharding(mesh, P())
  shardings = TrainState(step=repl, params=p_sh, opt_state=o_sh,
                         window=jax.tree.map(lambda _: repl, window))
  params = jax.jit(init_params, out_shardings=p_sh)(rng)
  opt_state = jax.jit(tx.init, out_shardings=o_sh)(params)
  state = TrainState(step=jax.device_put(jnp.zeros((), jnp.int32), repl), params=params,
                     opt_state=opt_state, window=jax.device_put(window, repl))
  return state, tx, shardings


def make_train_step(model: model_lib.TransformerLM, tx: optax.GradientTransformation,
                    config: ml_collections.ConfigDict, mesh: Mesh, state_shardings: Any
                    ) -> Callable[[TrainState, dict, jax.Array], tuple[TrainState, dict]]:
  """The jitted train step ``(state, batch, rng) -> (state, metrics)``; state is donated.

  Args:
    model: the model.
    tx: optimizer from ``optim.make_optimizer``.
    config: full config (``grad_accum_steps``, ``collect_stats``, ``optimizer``).
    mesh: mesh with axis ``'data'``.
    state_shardings: ``TrainState`` of shardings from ``init_state``.

  Returns:
    A function of ``state``, ``batch`` (dict of global ``[B, T]`` arrays, ``BATCH_KEYS``)
    and ``rng`` (PRNG key of this step, used for dropout) returning the new state and
    ``metrics``: float32 scalars ``loss`` (mean over scored targets), ``grad_norm``
    (global norm before clipping), ``learning_rate`` (of this update), ``tokens`` (real
    input tokens), ``targets`` (scored targets), ``finite`` (1.0 if loss and grad norm are
    finite).
  """
  accum = int(config.grad_accum_steps)
  collect = bool(config.collect_stats)
  row_scale = bool(config.optimizer.row_lr_scale)
  max_len, dim = model.config.max_len, model.config.emb_dim
  deterministic = model.config.dropout_rate == 0.0
  schedule = optim.make_schedule(config)
  has_table = _has_table(model)
  data_sh = NamedSharding(mesh, P(None, 'data'))

  def loss_fn(params, pert, mb, key, denom):
    variables = {'params': params}
    if pert is not None:
      variables['perturbations'] = pert
    logits = model.apply(variables, mb['inputs'], mb['positions'],
                         segment_ids=mb['segment_ids'], deterministic=deterministic,
                         rngs={'dropout': key})
    tl = token_losses(logits, mb['targets'])
    return jnp.sum(tl * mb['loss_mask'].astype(jnp.float32)) / denom, tl

  def micro(params, mb, key, denom):
    # The perturbation is taken in both modes so that the compiled loss and parameter
    # gradients are the same computation whether or not the statistics are collected.
    pert = {'embed_sum': jnp.zeros(mb['inputs'].shape + (dim,), jnp.float32)}
    (_, tl), (grads, gpert) = jax.value_and_grad(
        loss_fn, argnums=(0, 1), has_aux=True)(params, pert, mb, key, denom)
    loss = jnp.sum(tl * mb['loss_mask'].astype(jnp.float32)) / denom
    if not collect:
      # Loss by position is kept in both modes: with the same consumers of the token
      # losses, XLA compiles the loss identically whether or not statistics are on.
      return loss, grads, stats_lib.loss_stats(tl, mb, max_len)
    g = gpert['embed_sum'] * denom  # gradient of the sum-reduced loss
    return loss, grads, stats_lib.occurrence_stats(g, tl, mb, max_len)

  def step_fn(state, batch, rng):
    batch = {k: batch[k] for k in BATCH_KEYS}
    b = batch['inputs'].shape[0]
    real = batch['segment_ids'] > 0
    n_targets = jnp.sum(batch['loss_mask'].astype(jnp.float32))
    denom = jnp.maximum(n_targets, 1.0)
    if accum == 1:
      loss, grads, occ = micro(state.params, batch, jax.random.fold_in(rng, 0), denom)
    else:
      def split(x):
        x = x.reshape((b // accum, accum) + x.shape[1:]).swapaxes(0, 1)
        return jax.lax.with_sharding_constraint(x, data_sh)
      mbs = jax.tree.map(split, batch)
      zero_g = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
      fields = stats_lib.OCCURRENCE_FIELDS if collect else stats_lib.LOSS_FIELDS
      zero_occ = {k: v for k, v in stats_lib.zeros(max_len).items() if k in fields}
      if collect:
        zero_occ['g_sum'] = jnp.zeros((max_len, dim), jnp.float32)

      def body(carry, xs):
        i, mb = xs
        loss, grads, occ = micro(state.params, mb, jax.random.fold_in(rng, i), denom)
        c_loss, c_grads, c_occ = carry
        c_grads = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), c_grads, grads)
        return (c_loss + loss, c_grads, stats_lib.add(c_occ, occ)), None

      (loss, grads, occ), _ = jax.lax.scan(
          body, (jnp.zeros((), jnp.float32), zero_g, zero_occ),
          (jnp.arange(accum), mbs))
      grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)

    grad_norm = optax.tree.norm(grads)
    extra = {}
    if row_scale:
      extra['position_counts'] = jax.ops.segment_sum(
          real.reshape(-1).astype(jnp.float32), batch['positions'].reshape(-1),
          num_segments=max_len)
    updates, opt_state = tx.update(grads, state.opt_state, state.params, **extra)
    params = optax.apply_updates(state.params, updates)
    if collect:
      old = model_lib.position_table(state.params) if has_table else None
      new = model_lib.position_table(params) if has_table else None
      window = stats_lib.add(state.window, stats_lib.finish_step(occ, old, new))
    else:
      window = stats_lib.add(state.window, occ)
    metrics = {
        'loss': loss,
        'grad_norm': grad_norm,
        'learning_rate': jnp.asarray(schedule(state.step), jnp.float32),
        'tokens': jnp.sum(real.astype(jnp.float32)),
        'targets': n_targets,
        'finite': (jnp.isfinite(loss) & jnp.isfinite(grad_norm)).astype(jnp.float32),
    }
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state,
                           window=window)
    return new_state, metrics

  repl = NamedSharding(mesh, P())
  b_sh = {k: batch_sharding(mesh) for k in BATCH_KEYS}
  return jax.jit(step_fn, in_shardings=(state_shardings, b_sh, repl),
                 out_shardings=(state_shardings, repl), donate_argnums=(0,))


def global_batch(batch: dict[str, np.ndarray], mesh: Mesh,
                 max_len: int | None = None) -> dict[str, jax.Array]:
  """Assembles the process-local ``[B / process_count, T]`` rows into global arrays.

  Args:
    batch: this process's rows of each ``BATCH_KEYS`` array.
    mesh: mesh with axis ``'data'``.
    max_len: position-table rows; when given, every position id is checked on the host
      (a clear ``ValueError`` naming the bad id), so the compiled step can run without the
      model's in-graph guard (``model.check_positions``).

  Returns:
    Dict of global ``[B, T]`` jax arrays sharded by ``batch_sharding``.
  """
  missing = [k for k in BATCH_KEYS if k not in batch]
  if missing:
    raise KeyError(f'batch lacks {missing}; a batch must hold {list(BATCH_KEYS)} '
                   '(docs/DESIGN.md).')
  if max_len is not None:
    embeddings.check_position_range(np.asarray(batch['positions']), max_len)
  sh = batch_sharding(mesh)
  if jax.process_count() == 1:
    return {k: jax.device_put(np.asarray(batch[k]), sh) for k in BATCH_KEYS}
  return {k: jax.make_array_from_process_local_data(sh, np.asarray(batch[k]))
          for k in BATCH_KEYS}


def reset_window(state: TrainState) -> TrainState:
  """The state with zeroed statistics accumulators (same shardings)."""
  return state.replace(window=jax.tree.map(jnp.zeros_like, state.window))
