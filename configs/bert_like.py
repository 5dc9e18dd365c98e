"""BERT-like run: a causal LM with BERT-base's shape, init and 128-then-512
length schedule.

BERT pretraining (Devlin et al., appendix A.2) used sequences of 128 tokens for
90% of the steps and 512 for the last 10%, "to learn the positional embeddings",
so rows 128..511 of its table are trained far less. This config reproduces that
exposure pattern with BERT's initializer (TF truncated normal, std 0.02, cut at
2 std and not rescaled) on a causal LM, so the resulting table can be compared
with BERT's noisy rear rows. For accelerators.

  python train.py --config configs/bert_like.py --workdir runs/bert_like
"""

from flax_posemb import defaults


def get_config():
  config = defaults.base()
  # 36k steps at 128 tokens, then 4k steps at 512.
  config.num_train_steps = 40_000
  config.batch_size = 256  # BERT's batch size (rows per step).
  # Microbatches of 128 rows: fp32 logits 128 x 512 x 32k = 8.4 GB each.
  config.grad_accum_steps = 2
  # Metrics, statistics and a table snapshot every 100 steps.
  config.log_every_steps = 100
  # Held-out loss by position bucket every 2000 steps.
  config.eval_every_steps = 2000
  # Periodic checkpoints (plus step 0 and the end).
  config.checkpoint_every_steps = 2000
  # Long runs log to metrics.jsonl/TensorBoard instead.
  config.progress_bar = False
  # BERT trained on Wikipedia (+ BooksCorpus, not in TFDS).
  config.data.source = 'tfds'
  config.data.name = 'wiki40b/en'  # Wikipedia articles (TFDS).
  # Subword tokens (BERT: WordPiece, 30522).
  config.data.tokenizer = 'sentencepiece'
  # A 32k SentencePiece model trained on the corpus.
  config.data.spm_vocab_size = 32_000
  config.data.seq_len = 512  # Full length of the last phase = table size.
  # Short rows first, full rows at the end.
  config.data.position_policy = 'length_schedule'
  config.data.schedule_seq_len = 128  # BERT's short phase length.
  config.data.schedule_fraction = 0.9  # BERT: 90% of steps at 128, 10% at 512.
  config.data.num_workers = 8  # Grain worker processes feeding the accelerator.
  config.model.vocab_size = 32_000  # = data.spm_vocab_size.
  config.model.max_len = 512  # BERT's position table rows.
  config.model.num_layers = 12  # BERT-base.
  config.model.num_heads = 12  # 64 features per head.
  config.model.emb_dim = 768  # BERT-base width.
  config.model.mlp_dim = 3072  # 4 x width.
  config.model.dropout_rate = 0.1  # BERT's hidden and attention dropout.
  # TF truncated normal(0.02), realized std ~0.0176.
  config.model.position_init = 'bert'
  # BERT initializes every embedding table the same way.
  config.model.token_init = 'bert'
  # bf16 compute on accelerators; logits and loss stay fp32.
  config.model.dtype = 'bfloat16'
  config.model.param_dtype = 'float32'  # fp32 master parameters.
  config.optimizer.learning_rate = 1e-4  # BERT's peak learning rate.
  config.optimizer.warmup_steps = 1000  # Linear warmup (BERT: 10k of 1M steps).
  config.optimizer.b2 = 0.999  # BERT's Adam beta2.
  config.optimizer.eps = 1e-6  # BERT's Adam epsilon.
  # BERT's decoupled weight decay (embeddings included).
  config.optimizer.weight_decay = 0.01
  # Split at 128, the end of the short phase.
  config.eval.bucket_edges = '0,64,128,192,256,384,512'
  # Full-length 512-token held-out windows per evaluation.
  config.eval.num_windows = 256
  config.eval.batch_size = 32  # Windows per evaluation batch.
  return config
