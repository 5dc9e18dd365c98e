"""Runnable train/eval steps for each implementation, behind one small
interface.

Every builder returns a `Runner`: `call()` runs one step on a fixed device batch
(state is carried inside, donated buffers included), `lower()` gives the
`jax.stages.Lowered` of the step where it is a JAX function (for
`memory_analysis`), and `n_params_no_pos` feeds the FLOPs formula in
`common.flops_per_token`."""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from benchmarks import reference_model as ref


@dataclasses.dataclass
class Runner:
  """One implementation's step, ready to time."""

  name: str
  call: Callable[[], Any]
  n_params_no_pos: int
  lower: Callable[[], Any] | None = None
  note: str = ''


_CACHE: dict[Any, Runner] = {}


def library_train(
    shape: common.Shape, collect_stats: bool, seed: int = 0, **overrides
) -> Runner:
  """`flax_posemb.train_step.make_train_step` on a synthetic full batch.

  Runners are cached per arguments within a process, so suites that time the
  same step share one compilation (the state simply keeps training).

  Args:
    shape: model and batch shape.
    collect_stats: the config's `collect_stats`.
    seed: init / batch seed.
    **overrides: dotted config overrides, e.g. `{'model.remat': True}`.
  """
  key = (shape, collect_stats, seed, tuple(sorted(overrides.items())))
  if key not in _CACHE:
    _CACHE[key] = _library_train(shape, collect_stats, seed, **overrides)
  return _CACHE[key]


def _library_train(
    shape: common.Shape, collect_stats: bool, seed: int, **overrides
) -> Runner:
  # train_step and sharding hold the jitted step without the loop's data/Orbax
  # imports.
  from flax_posemb import auto
  from flax_posemb import sharding
  from flax_posemb import train_step as training

  config = common.model_config(shape, collect_stats=collect_stats, **overrides)
  # What train.py runs: auto attention and microbatches resolved.
  config, _ = auto.resolve_config(config)
  mesh = sharding.make_mesh()
  model = training.make_model(config)
  state, tx, shardings = training.init_state(
      model, config, mesh, jax.random.key(seed)
  )
  step = training.make_train_step(model, tx, config, mesh, shardings)
  batch = sharding.global_batch(common.synthetic_batch(shape, seed), mesh)
  rng = jax.random.key(seed + 1)
  box = [state]

  def call():
    box[0], metrics = step(box[0], batch, rng)
    return metrics['loss']

  n = sum(int(x.size) for x in jax.tree.leaves(state.params))
  pos = state.params.get('pos_embed', {}).get('embedding')
  n_no_pos = n - (int(pos.size) if pos is not None else 0)
  name = f"flax_posemb (stats {'on' if collect_stats else 'off'})"
  note = (
      f'{config.model.attention_impl} attention, {config.grad_accum_steps}'
      ' microbatch(es)'
  )
  return Runner(
      name, call, n_no_pos, lambda: step.lower(box[0], batch, rng), note
  )


def library_eval(shape: common.Shape, seed: int = 0, **overrides) -> Runner:
  """`flax_posemb.evaluation.make_eval_step` (loss by position and bucket) on
  one batch."""
  from flax_posemb import evaluation
  from flax_posemb import sharding
  from flax_posemb import train_step as training

  config = common.model_config(shape, collect_stats=False, **overrides)
  mesh = sharding.make_mesh()
  model = training.make_model(config)
  state, _, _ = training.init_state(model, config, mesh, jax.random.key(seed))
  edges = np.arange(0, shape.seq_len + 1, max(1, shape.seq_len // 8))
  step = evaluation.make_eval_step(
      evaluation.model_apply_fn(model), edges, mesh
  )
  batch = sharding.global_batch(common.synthetic_batch(shape, seed), mesh)
  params = state.params
  off = jnp.int32(0)
  n = sum(int(x.size) for x in jax.tree.leaves(params))
  return Runner(
      'flax_posemb eval',
      lambda: step(params, batch, off),
      n,
      lambda: step.lower(params, batch, off),
  )


def reference_train(
    shape: common.Shape,
    seed: int = 0,
    kernel_layout: str = 'in_out',
    segment_mask: bool = True,
) -> Runner:
  """The plain-JAX reference GPT-2 (`benchmarks.reference_model`)."""
  cfg = ref.RefConfig(
      shape.vocab_size,
      shape.num_layers,
      shape.num_heads,
      shape.emb_dim,
      shape.mlp,
      shape.seq_len,
      jnp.dtype(shape.dtype),
      kernel_layout,
      segment_mask,
  )
  params = ref.init(cfg, jax.random.key(seed))
  tx = ref.make_optimizer()
  step = ref.make_train_step(cfg, tx)
  box = [params, tx.init(params)]
  batch = jax.device_put(common.synthetic_batch(shape, seed))

  def call():
    box[0], box[1], loss = step(box[0], box[1], batch)
    return loss

  n_no_pos = ref.num_params(params) - int(params['wpe'].size)
  mask = 'segment+causal mask' if segment_mask else 'causal mask'
  return Runner(
      f'plain JAX reference ({kernel_layout}, {mask})',
      call,
      n_no_pos,
      lambda: step.lower(box[0], box[1], batch),
  )


def hf_flax_train(shape: common.Shape, seed: int = 0) -> Runner:
  """Hugging Face `FlaxGPT2LMHeadModel` with the same optax chain (raises
  ImportError if absent)."""
  import optax
  from transformers import FlaxGPT2LMHeadModel
  from transformers import GPT2Config

  conf = GPT2Config(
      vocab_size=shape.vocab_size,
      n_positions=shape.seq_len,
      n_embd=shape.emb_dim,
      n_layer=shape.num_layers,
      n_head=shape.num_heads,
      n_inner=shape.mlp,
      resid_pdrop=0.0,
      embd_pdrop=0.0,
      attn_pdrop=0.0,
  )
  model = FlaxGPT2LMHeadModel(
      conf,
      seed=seed,
      dtype=jnp.dtype(shape.dtype),
      input_shape=(1, shape.seq_len),
  )
  params = model.params
  tx = ref.make_optimizer()
  b = common.synthetic_batch(shape, seed)
  batch = jax.device_put(
      {k: b[k] for k in ('inputs', 'targets', 'positions', 'loss_mask')}
  )

  def loss_fn(p, batch):
    logits = model(
        batch['inputs'], position_ids=batch['positions'], params=p, train=False
    ).logits
    import optax as _o

    tl = _o.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch['targets']
    )
    return jnp.sum(tl * batch['loss_mask']) / jnp.maximum(
        jnp.sum(batch['loss_mask']), 1.0
    )

  def step(p, o, batch):
    loss, g = jax.value_and_grad(loss_fn)(p, batch)
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o, loss

  jstep = jax.jit(step, donate_argnums=(0, 1))
  box = [params, tx.init(params)]

  def call():
    box[0], box[1], loss = jstep(box[0], box[1], batch)
    return loss

  n = sum(int(x.size) for x in jax.tree.leaves(params))
  n_no_pos = n - shape.seq_len * shape.emb_dim
  return Runner(
      'HF FlaxGPT2LMHeadModel (causal mask)',
      call,
      n_no_pos,
      lambda: jstep.lower(box[0], box[1], batch),
  )


def torch_train(
    shape: common.Shape,
    compile_model: bool,
    seed: int = 0,
    threads: int | None = None,
    grad_accum_steps: int = 1,
) -> Runner:
  """Hugging Face PyTorch `GPT2LMHeadModel` (SDPA attention), AdamW, eager or
  `torch.compile`.

  `grad_accum_steps` cuts the batch into that many equal microbatches (row `i`
  in microbatch `i % grad_accum_steps`, as the library's step does) whose
  backward passes add up to the full batch's gradient, so both frameworks can be
  timed with the same microbatching. Raises ImportError if torch/transformers
  are absent."""
  import torch
  from transformers import GPT2Config
  from transformers import GPT2LMHeadModel

  if threads:
    torch.set_num_threads(threads)
  torch.manual_seed(seed)
  conf = GPT2Config(
      vocab_size=shape.vocab_size,
      n_positions=shape.seq_len,
      n_embd=shape.emb_dim,
      n_layer=shape.num_layers,
      n_head=shape.num_heads,
      n_inner=shape.mlp,
      resid_pdrop=0.0,
      embd_pdrop=0.0,
      attn_pdrop=0.0,
  )
  model = GPT2LMHeadModel(conf)
  try:
    model.config._attn_implementation = 'sdpa'
  except Exception:
    pass
  model.train()
  decay = [p for p in model.parameters() if p.dim() >= 2]
  no_decay = [p for p in model.parameters() if p.dim() < 2]
  opt = torch.optim.AdamW(
      [
          {'params': decay, 'weight_decay': 0.1},
          {'params': no_decay, 'weight_decay': 0.0},
      ],
      lr=3e-4,
      betas=(0.9, 0.95),
  )
  b = common.synthetic_batch(shape, seed)
  inputs = torch.from_numpy(b['inputs']).long()
  targets = torch.from_numpy(b['targets']).long()
  positions = torch.from_numpy(b['positions']).long()

  if shape.batch_size % grad_accum_steps:
    raise ValueError(
        f'batch {shape.batch_size} is not divisible by '
        f'grad_accum_steps={grad_accum_steps}'
    )
  micro = [
      tuple(
          t[i::grad_accum_steps].contiguous()
          for t in (inputs, targets, positions)
      )
      for i in range(grad_accum_steps)
  ]

  def fwd_loss(inputs, targets, positions):
    logits = model(input_ids=inputs, position_ids=positions).logits
    return (
        torch.nn.functional.cross_entropy(
            logits.float().view(-1, logits.shape[-1]), targets.view(-1)
        )
        / grad_accum_steps
    )

  loss_fn = torch.compile(fwd_loss) if compile_model else fwd_loss

  def call():
    opt.zero_grad(set_to_none=True)
    loss = 0.0
    for m in micro:
      part = loss_fn(*m)
      part.backward()
      loss += part.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return float(loss.detach())

  n = sum(p.numel() for p in model.parameters())
  n_no_pos = n - shape.seq_len * shape.emb_dim
  name = (
      f'PyTorch {torch.__version__}'
      f" {'torch.compile' if compile_model else 'eager'} (HF GPT2LMHeadModel)"
  )
  return Runner(
      name, call, n_no_pos, None, note=f'{torch.get_num_threads()} threads'
  )
