"""The base training config of every experiment at each scale: 'quick', 'cpu', 'accelerator'.

One base per scale, so runs whose resolved configs coincide across experiments are trained
once in a shared run store. Scales and their measured cost: docs/DESIGN.md "Experiments
outputs".
"""

from __future__ import annotations

import math

import ml_collections

from flax_posemb import defaults

SCALES = ('quick', 'cpu', 'accelerator')
# Scored tokens per optimizer step for every arm at a scale (budget.py matches rows to it):
# 2 full rows at 'quick', 5 at 'cpu', 16 at 'accelerator'.
TARGET_TOKENS_PER_STEP = {'quick': 64, 'cpu': 320, 'accelerator': 16 * 1024}

_SHARED = {
    'progress_bar': False, 'eval_every_steps': 0, 'data.source': 'synthetic',
    'data.position_policy': 'packed', 'model.position_embedding': 'learned',
    'model.position_init': 'gpt2', 'optimizer.b2': 0.95, 'optimizer.weight_decay': 0.1,
    'optimizer.decay_position_table': True,
    # Flax nn.Embed's default (std 1/sqrt(width), set below), so 'same_as_token' differs
    # from every position init's 0.02.
    'model.token_init': 'normal'}
_SMALL = {'data.synthetic.num_regimes': 2, 'data.synthetic.segment_len': 4,
          'model.num_heads': 2, 'eval.bucket_size': 8}
_PER_SCALE = {
    'quick': {  # The whole pipeline in seconds; its numbers mean nothing.
        **_SMALL, 'num_train_steps': 4, 'batch_size': 4, 'log_every_steps': 2,
        'checkpoint_every_steps': 4, 'data.seq_len': 32, 'data.schedule_seq_len': 8,
        'data.synthetic.num_docs': 2_000, 'model.num_layers': 1, 'model.emb_dim': 16,
        'model.mlp_dim': 32, 'model.max_len': 32, 'optimizer.warmup_steps': 1,
        'eval.num_windows': 4, 'eval.batch_size': 4},
    'cpu': {
        **_SMALL, 'num_train_steps': 500, 'batch_size': 16, 'log_every_steps': 25,
        'checkpoint_every_steps': 500, 'data.seq_len': 64, 'data.schedule_seq_len': 16,
        'data.synthetic.num_docs': 20_000,
        # 16 tokens: 500 steps learn the transition matrices (packed recovers ~0.9 in every
        # bucket), so the late-row penalty is measurable; with 64 the model stays below the
        # content-only filter everywhere.
        'data.synthetic.vocab_size': 16, 'model.num_layers': 2, 'model.emb_dim': 32,
        'model.mlp_dim': 128, 'model.max_len': 64, 'optimizer.warmup_steps': 20,
        'eval.num_windows': 64, 'eval.batch_size': 32},
    'accelerator': {  # GPT-2-small shapes.
        'num_train_steps': 5000, 'batch_size': 32, 'log_every_steps': 100,
        'checkpoint_every_steps': 1000, 'data.seq_len': 1024, 'data.schedule_seq_len': 128,
        'data.synthetic.vocab_size': 64, 'model.num_layers': 12, 'model.num_heads': 12,
        'model.emb_dim': 768, 'model.mlp_dim': 3072, 'model.max_len': 1024,
        'model.dtype': 'bfloat16', 'optimizer.learning_rate': 6e-4,
        'optimizer.warmup_steps': 200, 'eval.bucket_edges': '0,32,64,128,256,512,768,1024',
        'eval.num_windows': 256, 'eval.batch_size': 32},
}


def base_config(scale: str) -> ml_collections.ConfigDict:
  """The locked training config shared by every arm of every experiment at ``scale``."""
  c = defaults.base()
  c.update_from_flattened_dict({**_SHARED, **_PER_SCALE[scale]})
  c.model.token_init_std = 1.0 / math.sqrt(c.model.emb_dim)
  c.model.vocab_size = c.data.synthetic.vocab_size
  return c


def stated_settings(config: ml_collections.ConfigDict) -> dict[str, object]:
  """The settings every report states (token init, beta2, weight decay, corpus, shapes)."""
  d, m = config.data, config.model
  return {
      'token_init': m.token_init,
      'token_init_std': float(m.token_init_std),
      'beta2': float(config.optimizer.b2),
      'weight_decay': float(config.optimizer.weight_decay),
      'decay_position_table': bool(config.optimizer.decay_position_table),
      'corpus': d.source if d.source != 'tfds' else f'tfds:{d.name}',
      'tokenizer': d.tokenizer if d.source != 'synthetic' else 'synthetic',
      'seq_len': int(d.seq_len),
      'model': (f'{m.num_layers} layers, {m.num_heads} heads, width {m.emb_dim}, table '
                f'{m.max_len} rows'),
      'num_train_steps': int(config.num_train_steps),
  }
