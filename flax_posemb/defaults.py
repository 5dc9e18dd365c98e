"""Default configuration sections shared by every `configs/*.py`
(docs/DESIGN.md, Config)."""

import dataclasses

import ml_collections


def data() -> ml_collections.ConfigDict:
  """Data section: source, tokenizer, context length and position policy."""
  c = ml_collections.ConfigDict()
  c.source = 'synthetic'  # synthetic | stdlib | local_text | long_text | tfds
  # TFDS dataset name when source == 'tfds' (e.g. 'wiki40b/en', 'pg19').
  c.name = ''
  c.text_feature = 'text'  # Feature holding the text in a TFDS dataset.
  c.train_split = 'train'  # Split used for training.
  c.eval_split = 'validation'  # Split used for periodic and offline evaluation.
  # Where TFDS datasets are built/read; '' = $FLAX_POSEMB_DATA_DIR or
  # ~/.cache/flax_posemb.
  c.data_dir = ''
  c.local_glob = ''  # Glob of .txt/.jsonl files when source == 'local_text'.
  # local_text document unit: file | line | paragraph.
  c.local_split_by = 'file'
  # local_text/stdlib (long_text: its short documents): percent of documents (by
  # key hash) in 'validation'.
  c.val_percent = 5
  # Invalid UTF-8 text: replace (U+FFFD; counted, reported) | skip (drop the
  # document; counted) | error (refuse, naming the file).
  c.on_decode_error = 'replace'
  # byte | sentencepiece (ignored by the synthetic source).
  c.tokenizer = 'byte'
  c.spm_model = ''  # SentencePiece model file; '' = train one on the corpus.
  # Vocabulary size when training a SentencePiece model.
  c.spm_vocab_size = 4096
  # Tokens per training row (context length); must be <= model.max_len.
  c.seq_len = 128
  # natural | natural_chunked | packed | packed_reset | random_offset |
  # length_schedule | resampled
  c.position_policy = 'natural'
  c.schedule_seq_len = 32  # length_schedule: row length during the short phase.
  # length_schedule: fraction of num_train_steps at the short length.
  c.schedule_fraction = 0.9
  # resampled: uniform | full | comma-separated shares per length bucket.
  c.resample_dist = 'uniform'
  # Synthetic document lengths: wikipedia | uniform | full | comma-separated
  # shares.
  c.length_dist = 'wikipedia'
  c.min_doc_len = 2  # Documents shorter than this many tokens are dropped.
  c.shuffle = True  # Shuffle documents (deterministically from `seed`).
  # packed, packed_reset, natural_chunked: rows are shuffled in windows of this
  # many rows (a long document does not fill consecutive batches); <= 1 keeps
  # stream order.
  c.shuffle_rows = 8192
  c.num_workers = 0  # Grain worker processes (0 = in-process).
  c.prefetch = 2  # Batches prefetched by the Grain iterator.
  c.synthetic = ml_collections.ConfigDict()
  c.synthetic.vocab_size = 64  # Tokens in the synthetic vocabulary.
  # K: transition matrices cycled through by position.
  c.synthetic.num_regimes = 4
  # S: positions per regime before switching (K*S <= smallest bucket).
  c.synthetic.segment_len = 4
  # Dirichlet concentration of transition rows (lower = more predictable).
  c.synthetic.concentration = 0.1
  # Seed of the corpus itself (transition matrices), not of sampling.
  c.synthetic.seed = 1234
  # Documents per split (procedural: costs no storage).
  c.synthetic.num_docs = 100_000
  return c


def model() -> ml_collections.ConfigDict:
  """Model section: `flax_posemb.model.ModelConfig`'s fields and defaults
  (documented there)."""
  from flax_posemb import model as model_lib

  return ml_collections.ConfigDict(dataclasses.asdict(model_lib.ModelConfig()))


def optimizer() -> ml_collections.ConfigDict:
  """Optimizer section: AdamW + warmup/cosine schedule (optax)."""
  c = ml_collections.ConfigDict()
  c.learning_rate = 3e-3  # Peak learning rate.
  c.warmup_steps = 20  # Linear warmup steps from 0 to the peak.
  # Cosine decays to learning_rate * end_lr_ratio at num_train_steps.
  c.end_lr_ratio = 0.1
  c.b1 = 0.9  # Adam beta1.
  # Adam beta2 (stated explicitly: it sets how fast rare rows' second moments
  # decay).
  c.b2 = 0.95
  c.eps = 1e-8  # Adam epsilon.
  c.weight_decay = 0.1  # Decoupled weight decay on 2-D weights.
  # Apply weight decay to the position table (nanoGPT: yes; minGPT: no).
  c.decay_position_table = True
  c.decay_token_table = True  # Apply weight decay to the token table.
  c.grad_clip_norm = 1.0  # Global gradient-norm clip; <=0 disables.
  # Scale each position row's update by (mean exposure / row exposure)**power,
  # after Adam.
  c.row_lr_scale = False
  c.row_lr_power = 0.5  # Exponent of the per-row exposure scale.
  c.row_lr_max = 10.0  # Upper bound of the per-row scale.
  return c


def evaluation() -> ml_collections.ConfigDict:
  """Evaluation section: loss by position bucket (periodic eval and eval.py)."""
  c = ml_collections.ConfigDict()
  # Width of position buckets (used unless `bucket_edges` is set).
  c.bucket_size = 16
  # Comma-separated bucket edges, e.g. '0,128,256,512', or 'log2'.
  c.bucket_edges = ''
  # Evaluation windows (T+1 consecutive tokens each) per evaluation.
  c.num_windows = 64
  c.batch_size = 32  # Windows per evaluation batch.
  # Evaluation window length in tokens; 0 = model.max_len (the table size).
  c.window_len = 0
  # windows (full-length documents, positions 0..T-1) | natural (training
  # distribution).
  c.position_policy = 'windows'
  # windows: first (a document's first T+1 tokens) | deep (token-uniform windows
  # inside long documents; text sources; docs/DESIGN.md).
  c.window_start = 'first'
  # deep: only documents of at least this many tokens; 0 = 4 * window length.
  c.min_doc_len = 0
  # deep: no window starts before this token of its document; 0 = the window
  # length.
  c.min_start = 0
  # Seed that picks the evaluation documents (same texts across runs).
  c.seed = 0
  return c


# Fields that do not change what a run computes: the experiments' run identity
# ignores them.
NON_SEMANTIC = (
    'progress_bar',
    'checkpoint_every_steps',
    'max_to_keep',
    'data.num_workers',
    'data.prefetch',
    'data.data_dir',
    'allow_config_change',
)
# What a resume may change without allow_config_change (not data.num_workers:
# iterator state).
RESUME_MAY_CHANGE = tuple(
    k for k in NON_SEMANTIC if k != 'data.num_workers'
) + ('log_every_steps', 'eval_every_steps', 'eval')
# What a run saved before a field existed ran with, where not the default (a
# resume compares).
BEFORE_FIELD = {'data.shuffle_rows': 0}


def base() -> ml_collections.ConfigDict:
  """Full default config: training fields plus the four sections above."""
  c = ml_collections.ConfigDict()
  # Seed for model init, dropout and data order (paired across arms).
  c.seed = 0
  c.num_train_steps = 200  # Optimizer steps.
  # Global rows per optimizer step (split across devices and microbatches).
  c.batch_size = 32
  # Microbatches per optimizer step (same update); 0 = auto: ~1k-token ones on
  # CPU (cache-sized, faster), 1 on accelerators (flax_posemb.auto).
  c.grad_accum_steps = 0
  # Write metrics, statistics and a table snapshot every this many steps.
  c.log_every_steps = 20
  c.eval_every_steps = 100  # Periodic held-out evaluation; <=0 disables.
  # Periodic checkpoint; one is always written at the end.
  c.checkpoint_every_steps = 100
  # Checkpoints kept (the step-0 checkpoint is always kept too).
  c.max_to_keep = 3
  c.collect_stats = True  # Per-position gradient statistics in the train step.
  # Shard large matrices over the 'data' mesh axis as well as the batch.
  c.fsdp = False
  c.progress_bar = True  # tqdm progress bar with loss and tokens/s.
  # Resume even if the config changed in meaning (recorded in metrics.jsonl).
  c.allow_config_change = False
  # Stop (exit 3, nothing saved) when a step's loss exceeds this; <0 = 3 *
  # ln(model.vocab_size).
  c.divergence_loss = -1.0
  c.data = data()
  c.model = model()
  c.optimizer = optimizer()
  c.eval = evaluation()
  c.lock()  # A misspelled field in a config file is an error, not a new field.
  return c
