"""Default config: a small (0.86M-parameter) byte-level model on the offline
real-text corpus.

The corpus is the Python standard library's own source files
(`data.source='stdlib'`), so it needs no download. One document per row
(`natural`): late positions are seen less often than early ones, which is what
the per-position statistics and the loss-by-position evaluation are for.

Cost: 3000 steps of 16 x 256 tokens. A jitted AdamW step of this model (no
statistics) took 2.9 s at batch 16 and 3.9 s at batch 32 on the shared 2-core
development machine at load average ~8, i.e. hours for the run there; an idle
CPU is several times faster and an accelerator takes minutes. Shorten it on CPU
with `--config.num_train_steps=500`.

  python train.py --config configs/default.py --workdir runs/default
  python eval.py --workdir runs/default
"""

from flax_posemb import defaults


def get_config():
  config = defaults.base()
  # A few thousand steps: loss well past the unigram plateau.
  config.num_train_steps = 3000
  # Rows per optimizer step (16 x 256 = 4096 token slots).
  config.batch_size = 16
  # Metrics, statistics and a table snapshot every 100 steps.
  config.log_every_steps = 100
  # Held-out loss by position bucket every 500 steps.
  config.eval_every_steps = 500
  # Checkpoints every 500 steps and at the end.
  config.checkpoint_every_steps = 500
  # Offline real text: Python standard-library sources.
  config.data.source = 'stdlib'
  # UTF-8 bytes + a separator: vocabulary of 257, no files.
  config.data.tokenizer = 'byte'
  config.data.seq_len = 256  # Context length = table size.
  # One document per row: late positions are rarer.
  config.data.position_policy = 'natural'
  # = ByteTokenizer.vocab_size (256 bytes + separator).
  config.model.vocab_size = 257
  config.model.max_len = 256  # Position table rows = data.seq_len.
  config.model.num_layers = 4  # Four blocks.
  config.model.emb_dim = 128  # Width.
  config.model.num_heads = 4  # 32 features per head.
  config.model.mlp_dim = 512  # 4 x width.
  # Peak learning rate for a 0.86M-parameter model.
  config.optimizer.learning_rate = 1e-3
  config.optimizer.warmup_steps = 100  # Short linear warmup.
  config.eval.bucket_size = 32  # Eight buckets over 256 positions.
  # Full-length (256-byte) held-out windows per evaluation.
  config.eval.num_windows = 128
  return config
