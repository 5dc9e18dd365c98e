"""Imported GPT-2-family checkpoints (124M ... 1.5B) on long documents, in their
own tokens, on one accelerator: loss by position on deep windows at T=1024,
bf16 compute (docs/pretrained.md; time and memory there).

Import (the model's shape, its tokenizer and max_len come from the checkpoint;
this file gives the data, the evaluation and the dtypes), then evaluate:

  python -m flax_posemb.commands.import_hf --hf_dir ~/models/gpt2 \
      --workdir runs/gpt2 --config configs/gpt2_pretrained.py
  python eval.py --workdir runs/gpt2 --offsets 0,256 --analyze

Fine-tune from it with per-position statistics (`:WORKDIR` copies its shape and
tokenizer and sets init_from), e.g. on a table extended to 2048 rows:

  python train.py --config configs/gpt2_pretrained.py:runs/gpt2 \
      --workdir runs/gpt2_2048 --config.model.max_len=2048 \
      --config.data.seq_len=2048 --config.init_from_new_rows=copy_last
"""

from flax_posemb import defaults
from flax_posemb import init_from as init_from_lib


def get_config(init_from: str = ''):
  config = defaults.base()
  # Fine-tuning: short, at a small learning rate.
  config.num_train_steps = 1000
  config.batch_size = 16  # Rows per optimizer step (16k tokens at T=1024).
  # One accelerator batch; CPUs resolve 0 to ~1k-token microbatches.
  config.grad_accum_steps = 0
  # Metrics, statistics and a table snapshot every 50 steps.
  config.log_every_steps = 50
  # Held-out loss by position bucket every 250 steps.
  config.eval_every_steps = 250
  # Periodic checkpoints (plus step 0 and the end).
  config.checkpoint_every_steps = 250
  # Long runs log to metrics.jsonl/TensorBoard instead.
  config.progress_bar = False
  # Shakespeare, KJV Bible, Python docs + short stdlib documents.
  config.data.source = 'long_text'
  # The checkpoint's own tokenizer (the importer sets data.hf_tokenizer).
  config.data.tokenizer = 'hf'
  # GPT-2's context length (<= the model's max_len).
  config.data.seq_len = 1024
  # One document (its first T tokens) per row: the skewed exposure.
  config.data.position_policy = 'natural'
  # GPT-2 small's shape until the import replaces it with the checkpoint's.
  config.model.vocab_size = 50_257  # GPT-2's BPE vocabulary.
  config.model.max_len = 1024  # GPT-2's position table rows.
  config.model.num_layers = 12  # GPT-2 small.
  config.model.num_heads = 12  # 64 features per head.
  config.model.emb_dim = 768  # GPT-2 small width.
  config.model.mlp_dim = 3072  # 4 x width.
  # bf16 compute on accelerators; logits and loss stay fp32.
  config.model.dtype = 'bfloat16'
  config.model.param_dtype = 'float32'  # fp32 parameters.
  # Fine-tuning: 1e-4 peak (GPT-2 trained at 6e-4 .. 2e-4 by size).
  config.optimizer.learning_rate = 1e-4
  config.optimizer.warmup_steps = 50  # Linear warmup over 5% of the steps.
  # Uniform 64-token buckets: 16 over T=1024, 32 over an extended 2048.
  config.eval.bucket_size = 64
  # Held-out windows token-uniform over long documents (>= 4 contexts), past
  # their first context.
  config.eval.window_start = 'deep'
  # 256 windows of 1025 tokens (262k scored tokens).
  config.eval.num_windows = 256
  # Windows per evaluation batch: fp32 logits 16 x 1024 x 50257 = 3.3 GB.
  config.eval.batch_size = 16
  if init_from:
    # Start from that workdir: its shape, its tokenizer, init_from.
    init_from_lib.apply_source(config, init_from)
  return config
