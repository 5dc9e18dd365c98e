"""GPT-2 small shape (12 layers, 12 heads, width 768, context 1024) for
accelerators.

With the 32k SentencePiece vocabulary the model has about 110M parameters
(GPT-2's 124M counts a 50257-token vocabulary; the blocks and the 1024 x 768
position table are the same). bf16 compute, fp32 parameters. The corpus is
Wikipedia (`wiki40b/en`, a TFDS dataset prepared as array_record beforehand, see
docs/data.md) packed as GPT-2/nanoGPT pack it; override
`--config.data.position_policy=natural` for one document per row, or
`--config.data.source=local_text --config.data.local_glob=...` for your own long
texts.

  python train.py --config configs/gpt2_small.py --workdir runs/gpt2_small
"""

from flax_posemb import defaults


def get_config():
  config = defaults.base()
  config.num_train_steps = 20_000  # 20k x 256 x 1024 = 5.2B token slots.
  config.batch_size = 256  # Rows per optimizer step (262k tokens).
  # Microbatches of 64 rows: fp32 logits 64 x 1024 x 32k = 8.4 GB each.
  config.grad_accum_steps = 4
  # Metrics, statistics and a table snapshot every 100 steps.
  config.log_every_steps = 100
  # Held-out loss by position bucket every 1000 steps.
  config.eval_every_steps = 1000
  # Periodic checkpoints (plus step 0 and the end).
  config.checkpoint_every_steps = 1000
  # Long runs log to metrics.jsonl/TensorBoard instead.
  config.progress_bar = False
  config.data.source = 'tfds'  # A TFDS corpus of long documents.
  # Wikipedia articles (TFDS), text feature 'text'.
  config.data.name = 'wiki40b/en'
  # Subword tokens, as GPT-2 uses (BPE there).
  config.data.tokenizer = 'sentencepiece'
  # A 32k SentencePiece model trained on the corpus.
  config.data.spm_vocab_size = 32_000
  config.data.seq_len = 1024  # GPT-2's context length.
  # GPT-2/nanoGPT: documents concatenated into full rows.
  config.data.position_policy = 'packed'
  config.data.num_workers = 8  # Grain worker processes feeding the accelerator.
  config.model.vocab_size = 32_000  # = data.spm_vocab_size.
  config.model.max_len = 1024  # Position table rows = context length.
  config.model.num_layers = 12  # GPT-2 small.
  config.model.num_heads = 12  # 64 features per head.
  config.model.emb_dim = 768  # GPT-2 small width.
  config.model.mlp_dim = 3072  # 4 x width.
  # bf16 compute on accelerators; logits and loss stay fp32.
  config.model.dtype = 'bfloat16'
  config.model.param_dtype = 'float32'  # fp32 master parameters.
  # nanoGPT's GPT-2 small peak learning rate.
  config.optimizer.learning_rate = 6e-4
  # Linear warmup over the first 5% of steps.
  config.optimizer.warmup_steps = 1000
  # Finer buckets early, where loss falls fastest.
  config.eval.bucket_edges = '0,32,64,128,256,512,768,1024'
  # Full-length 1024-token held-out windows per evaluation.
  config.eval.num_windows = 256
  config.eval.batch_size = 32  # Windows per evaluation batch.
  return config
