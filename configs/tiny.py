"""Tiny config: the synthetic position-dependent corpus, a 2-layer model, ~1
minute on 2 CPU cores.

python train.py --config configs/tiny.py --workdir runs/tiny
python eval.py --workdir runs/tiny
"""

from flax_posemb import defaults


def get_config():
  config = defaults.base()
  # Enough for a clearly lower loss on the synthetic corpus.
  config.num_train_steps = 300
  config.batch_size = 16  # Rows per optimizer step.
  # Metrics, statistics and a table snapshot every 25 steps.
  config.log_every_steps = 25
  # Held-out loss by position bucket every 100 steps.
  config.eval_every_steps = 100
  config.checkpoint_every_steps = 100  # Checkpoints at 100, 200 and the end.
  # Procedural corpus with a known optimal loss per position.
  config.data.source = 'synthetic'
  config.data.seq_len = 128  # Context length = table size.
  # Natural exposure (late positions rare), no padding.
  config.data.position_policy = 'packed_reset'
  config.model.vocab_size = 64  # = data.synthetic.vocab_size.
  config.model.max_len = 128  # Position table rows.
  config.model.num_layers = 2  # Two blocks.
  config.model.emb_dim = 64  # Width.
  config.model.mlp_dim = 256  # 4 x width.
  config.model.num_heads = 4  # 16 features per head.
  config.eval.bucket_size = 16  # Eight buckets over 128 positions.
  config.eval.num_windows = 64  # Full-length evaluation documents.
  return config
