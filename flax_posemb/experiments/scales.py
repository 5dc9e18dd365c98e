"""Shared training configs of the experiments at each scale: 'quick', 'cpu', 'accelerator'.

All three experiments start from the same ``base_config(scale)``, so runs whose resolved
configs coincide (e.g. ``packed_reset`` + ``gpt2`` + decay on the table in ``exposure`` and
``init_x_exposure``) are trained once when the experiments share a run store
(``--run_store``).

Stated for every report (``stated_settings``): the token-embedding init, Adam ``beta2``,
weight decay on the position table, and the corpus.

* ``quick``: a few steps of a 1-layer width-16 model, context 32: the whole pipeline in
  seconds (tests, ``--quick``). Its numbers mean nothing.
* ``cpu``: a 2-layer width-32 model, context 64, a 16-token synthetic vocabulary, 500 steps
  of 320 scored tokens: sized so
  that the three experiments (145 distinct runs in a shared store) finish in about 35
  minutes on 2 CPU cores. Measured user+sys CPU per run (500 steps, warm compilation cache,
  shared machine): packed / packed_reset 7.4-7.9 s, natural / random_offset 55-59 s (71 rows
  of 64 per step: ~94% padding), length_schedule 20 s (synthetic), real-text arms 5.8-8.0 s;
  a config's first run adds ~8-14 s of compilation. Predicted total ~2100 s CPU.
* ``accelerator``: GPT-2-small shapes (12 layers, 12 heads, width 768, context 1024,
  bfloat16 compute), for one accelerator.
"""

from __future__ import annotations

import math

import ml_collections

from flax_posemb import defaults

SCALES = ('quick', 'cpu', 'accelerator')
# Scored (unmasked) tokens per optimizer step for every arm of every experiment at a scale
# (budget.py sets each arm's rows per step to match): 2 full rows at 'quick', 5 at 'cpu',
# 16 at 'accelerator'. Padded policies get many more rows of the same length.
TARGET_TOKENS_PER_STEP = {'quick': 64, 'cpu': 320, 'accelerator': 16 * 1024}


def base_config(scale: str) -> ml_collections.ConfigDict:
  """Training config shared by every arm of every experiment at ``scale``.

  Args:
    scale: 'quick', 'cpu' or 'accelerator'.

  Returns:
    A full (locked) training config, as ``configs/*.py`` return.
  """
  if scale not in SCALES:
    raise ValueError(f'unknown experiment scale {scale!r}; use one of {SCALES}.')
  c = defaults.base()
  c.progress_bar = False  # Sweeps log one line per run instead.
  c.data.source = 'synthetic'
  c.data.position_policy = 'packed'
  c.model.position_embedding = 'learned'
  c.model.position_init = 'gpt2'
  c.optimizer.b2 = 0.95
  c.optimizer.weight_decay = 0.1
  c.optimizer.decay_position_table = True
  if scale == 'quick':
    c.num_train_steps = 4
    c.batch_size = 4
    c.log_every_steps = 2
    c.eval_every_steps = 0
    c.checkpoint_every_steps = 4
    c.data.seq_len = 32
    c.data.schedule_seq_len = 8
    c.data.synthetic.num_regimes = 2
    c.data.synthetic.segment_len = 4
    c.data.synthetic.num_docs = 2_000
    c.model.num_layers = 1
    c.model.num_heads = 2
    c.model.emb_dim = 16
    c.model.mlp_dim = 32
    c.model.max_len = 32
    c.optimizer.warmup_steps = 1
    c.eval.bucket_size = 8
    c.eval.num_windows = 4
    c.eval.batch_size = 4
  elif scale == 'cpu':
    c.num_train_steps = 500
    c.batch_size = 16
    c.log_every_steps = 25
    c.eval_every_steps = 0
    c.checkpoint_every_steps = 500
    c.data.seq_len = 64
    c.data.schedule_seq_len = 16
    c.data.synthetic.num_regimes = 2
    c.data.synthetic.segment_len = 4
    c.data.synthetic.num_docs = 20_000
    # 16 tokens: 500 steps suffice to learn the K transition matrices (packed, seed 0:
    # recovered ~0.9 in every bucket), so the late-row penalty is measurable; with 64 tokens
    # the model stays worse than the content-only filter everywhere (recovered < 0).
    c.data.synthetic.vocab_size = 16
    c.model.num_layers = 2
    c.model.num_heads = 2
    c.model.emb_dim = 32
    c.model.mlp_dim = 128
    c.model.max_len = 64
    c.optimizer.warmup_steps = 20
    c.eval.bucket_size = 8
    c.eval.num_windows = 64
    c.eval.batch_size = 32
  else:  # accelerator: GPT-2-small shapes.
    c.num_train_steps = 5000
    c.batch_size = 32
    c.log_every_steps = 100
    c.eval_every_steps = 0
    c.checkpoint_every_steps = 1000
    c.data.seq_len = 1024
    c.data.schedule_seq_len = 128
    c.data.synthetic.vocab_size = 64
    c.model.num_layers = 12
    c.model.num_heads = 12
    c.model.emb_dim = 768
    c.model.mlp_dim = 3072
    c.model.max_len = 1024
    c.model.dtype = 'bfloat16'
    c.optimizer.learning_rate = 6e-4
    c.optimizer.warmup_steps = 200
    c.eval.bucket_edges = '0,32,64,128,256,512,768,1024'
    c.eval.num_windows = 256
    c.eval.batch_size = 32
  # Token init differs from every position init's 0.02 so that 'same_as_token' is its own
  # arm: Flax nn.Embed's default, std 1/sqrt(width).
  c.model.token_init = 'normal'
  c.model.token_init_std = 1.0 / math.sqrt(c.model.emb_dim)
  c.model.vocab_size = c.data.synthetic.vocab_size
  return c


def stated_settings(config: ml_collections.ConfigDict) -> dict[str, object]:
  """The settings every report must state, read from a resolved training config.

  Args:
    config: a resolved training config.

  Returns:
    JSON-ready dict: token init (and std), beta2, weight decay and whether it applies to the
    position table, corpus, tokenizer, context length and model shape.
  """
  return {
      'token_init': config.model.token_init,
      'token_init_std': float(config.model.token_init_std),
      'beta2': float(config.optimizer.b2),
      'weight_decay': float(config.optimizer.weight_decay),
      'decay_position_table': bool(config.optimizer.decay_position_table),
      'corpus': config.data.source if config.data.source != 'tfds'
                else f'tfds:{config.data.name}',
      'tokenizer': config.data.tokenizer if config.data.source != 'synthetic' else 'synthetic',
      'seq_len': int(config.data.seq_len),
      'model': (f'{config.model.num_layers} layers, {config.model.num_heads} heads, width '
                f'{config.model.emb_dim}, table {config.model.max_len} rows'),
      'num_train_steps': int(config.num_train_steps),
  }
