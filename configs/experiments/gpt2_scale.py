"""gpt2_scale: the rare-late-row claim at GPT-2-small shape on a corpus that
does not repeat, at three model sizes (one GPU).

  python -m flax_posemb.experiments configs/experiments/gpt2_scale.py \
      --workdir runs/gpt2_scale

Corpus: `pg19` (Project Gutenberg books before 1919, TFDS, text feature
`book_text`), prepared through the project as docs/data.md says (`pip install
-e ".[prepare]"`, `tfds build pg19 --file_format=array_record --data_dir=DIR`,
then `FLAX_POSEMB_DATA_DIR=DIR`). Its train split is 28,602 books, 1.97B words
(Rae et al., 2020), about 2.6B tokens with the project's 32k SentencePiece
(~1.3 tokens per word; trained on the train split on first use, as
configs/gpt2_small.py does). It is chosen over wiki40b/en because its held-out
books (50 validation books, ~4M tokens) are long enough for deep full-context
windows (`eval.window_start='deep'` needs documents of 4 contexts, 4,096
tokens, which few Wikipedia articles reach). The tokenizer is SentencePiece's
unigram subwords, not GPT-2's byte-level BPE: for GPT-2's own BPE (50,257
tokens) add `('data.tokenizer', 'hf')`, `('data.hf_tokenizer', DIR)` and
`('model.vocab_size', 50257)` to `CORPUS` (DIR: an imported GPT-2's
`tokenizer/`, docs/pretrained.md).

Budget: every run trains 10,000 steps of 16 full rows' worth of scored tokens
(16,384 per step; the budget rule gives each arm its rows), 164M tokens: 6% of
the train split, so no run repeats a token (0.06 epochs); the 45 runs together
read 7.4B token slots, each seed's arms one shared stream
(`data.shared_stream`).

Sizes (context 1024, 4x MLP, bf16 compute): `d768` GPT-2 small (12 layers,
width 768, 12 heads: 110M parameters with the 32k vocabulary, 124M with
GPT-2's), `d512` (6 layers, width 512, 8 heads: 35M) and `d256` (4 layers,
width 256, 4 heads: 11M). Arms per size: `packed` (the control: flat exposure,
every token at context = position), `crops/natural` (natural's exposure on the
same token stream), `crops/skew:3e-05` (late rows seen 3e-5 times as often as
the first: at this budget ~50 occurrences per last row against ~1.7M for the
first, the rare regime of long_text_doses' skew:0.003), and each crops arm's
random-offset twin (`/twin`, `data.offset_twin`: same rows, tokens and
contexts, positions shifted by a random offset per row). Seeds 0-2.

Pre-registered per size, on the last bucket (896-1024) of deep windows:
`rows` (crops/skew - its twin: the rows' own part, > 0), `context` (twin -
packed: less long-context training, > 0), `natural_rows` (crops/natural - its
twin, > 0) and `late` (crops/skew - packed on last minus mid bucket, mid
128-256, > 0). Holm over the experiment's 12 claims.

Expected time on one H100 (989 TFLOP/s dense bf16), from 6N + 12 L D T FLOPs
per token (N counting the blocks and the 32k output projection): d768 0.77
GFLOP/token, 1.26e17 FLOP per run, 5.3-7.1 min at 40-30% MFU; d512 0.25
GFLOP/token, 1.7-2.3 min; d256 0.08 GFLOP/token, 0.6-0.7 min (small models
reach lower MFU: count 1-2 min). 15 runs per size: about 80-106 + 26-35 +
15-30 min, plus compilation (once per shape, cached) and 3 x 256-window
evaluations per run: about 2.5-3 hours. An estimate: no GPU run was made.

Where it runs: the experiments CLI on a GPU machine with the runner's
dependencies. The route of `benchmarks/accel.sh` (the device tool's image)
cannot run it, and the missing pieces are: the packages ml-collections, grain,
tensorflow-datasets, array-record, tensorboardX, sentencepiece, scipy and
matplotlib (absent from the image: carry their wheels); the prepared pg19
(~11 GiB as array_record, over the device tool's 64 MiB carry limit, and the
machine reaches no network, so it cannot build it there either); and 2.5-3
hours of device time (the tool lends 15 minutes per task). `--quick` runs its
two quick arms at a context of 128 in 30 steps; `gpt2_scale.py:tiny` is the
same design on a tiny corpus with byte tokens (`TINY_CORPUS`, prepared with
`python -m flax_posemb.commands.prepare --name gpt2_scale_tiny ...`) and 512
scored tokens per step, which tests/test_experiment_configs.py runs on CPU with
`--quick` (about a minute).
"""

from flax_posemb.experiments import spec

CONTROL = 'packed'
RARE = 'crops/skew:3e-05'
TWINNED = ('crops/natural', RARE)
# name -> (layers, width, heads).
SIZES = {'d256': (4, 256, 4), 'd512': (6, 512, 8), 'd768': (12, 768, 12)}
# 128-256: past the buckets where loss still falls with context.
MID_BUCKET = 2
CORPUS = (
    ('data.source', 'tfds'),
    ('data.name', 'pg19'),
    ('data.tokenizer', 'sentencepiece'),
    ('data.spm_vocab_size', 32_000),
    ('model.vocab_size', 32_000),
)
# `:tiny`: a dataset prepared from any text with the project's prepare command
# (byte tokens: a SentencePiece model needs more text than a test has).
TINY_CORPUS = (
    ('data.source', 'tfds'),
    ('data.name', 'gpt2_scale_tiny'),
    ('data.tokenizer', 'byte'),
    ('model.vocab_size', 257),
)
SHAPE = (
    ('data.seq_len', 1024),
    ('model.max_len', 1024),
    ('model.dtype', 'bfloat16'),
    ('data.shuffle_rows', 16384),
    ('data.num_workers', 8),
    ('data.shared_stream', True),
    ('num_train_steps', 10_000),
    ('checkpoint_every_steps', 2_000),
    ('optimizer.warmup_steps', 500),
    ('eval.window_start', 'deep'),
    ('eval.bucket_edges', '0,64,128,256,512,768,896'),
    ('eval.num_windows', 256),
)
# --quick: the pipeline at a context of 128 in 30 steps (numbers mean
# nothing); applied after each arm's size.
QUICK_OVERRIDES = (
    ('data.seq_len', 128),
    ('model.max_len', 128),
    ('model.num_layers', 1),
    ('model.emb_dim', 16),
    ('model.num_heads', 2),
    ('model.mlp_dim', 64),
    ('model.dtype', 'float32'),
    ('data.shuffle_rows', 256),
    ('data.num_workers', 0),
    ('num_train_steps', 30),
    ('log_every_steps', 10),
    ('checkpoint_every_steps', 30),
    ('optimizer.warmup_steps', 5),
    ('eval.bucket_edges', '0,16,32,64,96,112'),
    ('eval.num_windows', 16),
    ('eval.batch_size', 16),
)


def size(layers: int, width: int, heads: int) -> dict:
  """Overrides of one model size."""
  return {
      'model.num_layers': layers,
      'model.emb_dim': width,
      'model.num_heads': heads,
      'model.mlp_dim': 4 * width,
      'model.token_init_std': 0.02,
  }


def policy(name: str) -> dict:
  """The data overrides of arm kind ``name`` (twins: ``.../twin``)."""
  kind = name.removesuffix('/twin')
  if kind == CONTROL:
    overrides: dict = {'data.position_policy': 'packed'}
  else:
    overrides = {
        'data.position_policy': 'crops',
        'data.crop_lengths': kind.removeprefix('crops/'),
    }
  if name.endswith('/twin'):
    overrides['data.offset_twin'] = True
  return overrides


def get_config(arg: str = 'accelerator'):
  """The experiment; ``arg`` 'tiny' reads `TINY_CORPUS` (CPU tests)."""
  if arg not in ('accelerator', 'tiny'):
    raise ValueError(
        f"gpt2_scale.py takes ':accelerator' (the default) or ':tiny', got"
        f' {arg!r}.'
    )
  c = spec.new(
      'gpt2_scale',
      'Rare late rows at GPT-2-small shape on a corpus that does not repeat',
      'At GPT-2-small shape (context 1024) and two smaller sizes, on books'
      ' read once, do late rows seen ~1/30,000 as often as the first score'
      ' the last bucket worse than their random-offset twin (the rows) and'
      ' does the twin score it worse than packed rows (long-context'
      ' training)?',
      'accelerator' if arg == 'accelerator' else 'cpu',
  )
  corpus = CORPUS if arg == 'accelerator' else TINY_CORPUS
  c.base_overrides = corpus + SHAPE
  # 16 full rows of 1024; ':tiny' (CPU, --quick's rows of 128): 4 full rows.
  c.budget.target_tokens_per_step = 16_384.0 if arg == 'accelerator' else 512.0
  c.seeds = (0, 1, 2)
  c.mid_bucket = MID_BUCKET
  c.offsets = (0, 128)
  c.quick_overrides = QUICK_OVERRIDES
  c.quick_offsets = (0, 32)
  kinds = (CONTROL,) + tuple(
      name for kind in TWINNED for name in (kind, f'{kind}/twin')
  )
  arms, claims = [], []
  for name, shape in SIZES.items():
    for kind in kinds:
      arms.append(spec.arm(f'{name}/{kind}', {**policy(kind), **size(*shape)}))
    claims += _claims(name)
  c.arms = tuple(arms)
  c.claims = tuple(claims)
  c.profiles = tuple(
      spec.profile(
          'bucket_loss',
          tuple(f'{name}/{kind}' for kind in kinds),
          f'{name}/{CONTROL}',
          f'{name}: held-out loss, deep full-context windows',
      )
      for name in SIZES
  ) + (
      spec.profile(
          'bucket_exposure',
          tuple(f'd256/{kind}' for kind in kinds),
          '',
          'training exposure per row',
      ),
  )
  c.quick_arms = (f'd256/{RARE}', f'd256/{RARE}/twin')
  c.report_scalars = ('loss_late', 'loss_late_minus_mid', 'final_loss')
  return c


def _claims(name: str) -> list:
  """The pre-registered claims of size ``name``."""
  rare = f'{name}/{RARE}'
  return [
      spec.claim(
          f'{name}:rows',
          f"{name}: the rare rows' own part: the last bucket scores worse"
          ' than their twin (same tokens and contexts)',
          'loss_late',
          rare,
          f'{rare}/twin',
          'greater',
      ),
      spec.claim(
          f'{name}:context',
          f'{name}: less long-context training (the twin) scores the last'
          ' bucket worse than packed rows',
          'loss_late',
          f'{rare}/twin',
          f'{name}/{CONTROL}',
          'greater',
      ),
      spec.claim(
          f'{name}:natural_rows',
          f"{name}: natural exposure's rows: the last bucket scores worse"
          ' than their twin',
          'loss_late',
          f'{name}/crops/natural',
          f'{name}/crops/natural/twin',
          'greater',
      ),
      spec.claim(
          f'{name}:late',
          f'{name}: rare late rows score late minus mid worse than packed',
          'loss_late_minus_mid',
          rare,
          f'{name}/{CONTROL}',
          'greater',
      ),
  ]
