"""Experiment configs: base config per scale, loading, validation (once, here),
the grid."""

from collections.abc import Iterable, Mapping
import dataclasses
import functools
import hashlib
import json
import math
import os
import runpy
from typing import Any

import ml_collections

from flax_posemb import defaults
from flax_posemb.experiments import verdicts

BUDGET_MODES = ('real_tokens', 'none')
# Scored tokens per optimizer step of every arm (the budget): 2 full rows at
# 'quick', 5 at 'cpu', 16 at 'accelerator'.
TARGET_TOKENS_PER_STEP = {'quick': 64, 'cpu': 320, 'accelerator': 16 * 1024}

_SHARED: dict[str, Any] = {
    'progress_bar': False,
    'eval_every_steps': 0,
    'data.source': 'synthetic',
    'data.position_policy': 'packed',
    'model.position_embedding': 'learned',
    'model.position_init': 'gpt2',
    'optimizer.b2': 0.95,
    'optimizer.weight_decay': 0.1,
    'optimizer.decay_position_table': True,
    # Flax nn.Embed's default (std 1/sqrt(width), set below), so 'same_as_token'
    # differs from every position init's 0.02.
    'model.token_init': 'normal',
}
_SMALL: dict[str, Any] = {
    'data.synthetic.num_regimes': 2,
    'data.synthetic.segment_len': 4,
    'model.num_heads': 2,
    'eval.bucket_size': 8,
}
_PER_SCALE: dict[str, dict[str, Any]] = {
    'quick': {  # The whole pipeline in seconds; its numbers mean nothing.
        **_SMALL,
        'num_train_steps': 4,
        'batch_size': 4,
        'log_every_steps': 2,
        'checkpoint_every_steps': 4,
        'data.seq_len': 32,
        'data.schedule_seq_len': 8,
        'data.synthetic.num_docs': 2_000,
        'model.num_layers': 1,
        'model.emb_dim': 16,
        'model.mlp_dim': 32,
        'model.max_len': 32,
        'optimizer.warmup_steps': 1,
        'eval.num_windows': 4,
        'eval.batch_size': 4,
    },
    'cpu': {
        **_SMALL,
        'num_train_steps': 500,
        'batch_size': 16,
        'log_every_steps': 25,
        'checkpoint_every_steps': 500,
        'data.seq_len': 64,
        'data.schedule_seq_len': 16,
        'data.synthetic.num_docs': 20_000,
        # 16 tokens: 500 steps learn the transition matrices (packed recovers
        # ~0.9 in every bucket), so the late-row penalty is measurable; with 64
        # the model stays below the content-only filter everywhere.
        'data.synthetic.vocab_size': 16,
        'model.num_layers': 2,
        'model.emb_dim': 32,
        'model.mlp_dim': 128,
        'model.max_len': 64,
        'optimizer.warmup_steps': 20,
        'eval.num_windows': 64,
        'eval.batch_size': 32,
    },
    'accelerator': {  # GPT-2-small shapes.
        'num_train_steps': 5000,
        'batch_size': 32,
        'log_every_steps': 100,
        'checkpoint_every_steps': 1000,
        'data.seq_len': 1024,
        'data.schedule_seq_len': 128,
        'data.synthetic.vocab_size': 64,
        'model.num_layers': 12,
        'model.num_heads': 12,
        'model.emb_dim': 768,
        'model.mlp_dim': 3072,
        'model.max_len': 1024,
        'model.dtype': 'bfloat16',
        'optimizer.learning_rate': 6e-4,
        'optimizer.warmup_steps': 200,
        'eval.bucket_edges': '0,32,64,128,256,512,768,1024',
        'eval.num_windows': 256,
        'eval.batch_size': 32,
    },
}


def base_config(scale: str) -> ml_collections.ConfigDict:
  """The locked training config shared by every arm of every experiment at
  ``scale``."""
  c = defaults.base()
  c.update_from_flattened_dict({**_SHARED, **_PER_SCALE[scale]})
  c.model.token_init_std = 1.0 / math.sqrt(c.model.emb_dim)
  c.model.vocab_size = c.data.synthetic.vocab_size
  return c


def new(
    name: str, title: str, question: str, scale: str = 'cpu'
) -> ml_collections.ConfigDict:
  """An experiment config with every field at its default (fill arms, claims,
  ...)."""
  c = ml_collections.ConfigDict()
  c.name = name
  c.title = title
  c.question = question  # One paragraph.
  c.scale = scale  # 'cpu' | 'accelerator': base_config.
  # Dotted-key overrides of the base config for every arm.
  c.base_overrides = ()
  c.arms = ()  # arm(...) each.
  # Seed s of every arm shares data order and model init.
  c.seeds = (0, 1, 2, 3, 4)
  c.claims = ()  # claim(...) each, judged by verdicts.verdict.
  # profile(...) each: per-bucket comparisons to tabulate and plot.
  c.profiles = ()
  c.analyses = ()  # Cross-arm analyses: ('cosine_convergence',) or none.
  c.convergence_threshold = 0.9  # Agreement level of 'cosine_convergence'.
  c.offsets = ()  # Offset-probe shifts of the final evaluation, e.g. (0, 16).
  c.quick_arms = ()  # The two arms --quick runs (one seed, the 'quick' scale).
  c.quick_overrides = ()  # Applied after the arm's overrides under --quick.
  # --quick's offset-probe shifts (() = offsets): quick rows are shorter.
  c.quick_offsets = ()
  c.rare_exposure = 100.0  # Rows seen fewer times than this are "rare".
  # The pre-registered "mid" bucket of claims on late minus mid (an index past
  # the first bucket, whose loss is dominated by short context; -1: none).
  c.mid_bucket = -1
  # dose(...) each: content-matched arms against the exposure of their late
  # rows (the dose-response figure).
  c.doses = ()
  c.report_scalars = ()  # Extra per-arm scalars tabulated in REPORT.md.
  # What changed since the previous committed report (listed first).
  c.notes = ()
  c.budget = ml_collections.ConfigDict(
      {
          'equalize': 'real_tokens',  # BUDGET_MODES (sweep.equalize).
          'target_tokens_per_step': float(TARGET_TOKENS_PER_STEP.get(scale, 0)),
          # Keeps the base batch size when no target is set (<= 0).
          'reference_arm': '',
          # Batches drawn to measure scored tokens per row.
          'estimate_batches': 20,
      }
  )
  return c


def arm(
    name: str, overrides: Mapping[str, Any] | None = None, label: str = ''
) -> ml_collections.ConfigDict:
  """One arm: a name ('packed', 'stdlib/natural', ...) and dotted-key
  overrides."""
  pairs = tuple((str(k), v) for k, v in (overrides or {}).items())
  return ml_collections.ConfigDict(
      {'name': name, 'label': label or name, 'overrides': pairs}
  )


def claim(
    claim_id: str,
    text: str,
    metric: str,
    arm_name: str,
    baseline: str,
    direction: str,
    margin: float = 0.0,
    about_late_rows: bool = False,
) -> ml_collections.ConfigDict:
  """A claim on per-seed ``metric(arm) - metric(baseline)`` (baseline '': 0),
  `verdicts.verdict`; ``about_late_rows``: a claim about the late rows
  themselves, on a contrast of the last bucket with another
  (`verdicts.late_rows_rule`)."""
  return ml_collections.ConfigDict(
      {
          'id': claim_id,
          'text': text,
          'metric': metric,
          'arm': arm_name,
          'baseline': baseline,
          'direction': direction,
          'margin': float(margin),
          'about_late_rows': bool(about_late_rows),
      }
  )


def dose(
    name: str, arms: Iterable[str], baseline: str
) -> ml_collections.ConfigDict:
  """A dose-response series: ``arms`` (ordered by the exposure of their late
  rows) against ``baseline``, one panel named ``name``."""
  return ml_collections.ConfigDict(
      {'name': name, 'arms': tuple(arms), 'baseline': baseline}
  )


def profile(
    metric: str, arms: Iterable[str], baseline: str = '', title: str = ''
) -> ml_collections.ConfigDict:
  """``metric`` per bucket across ``arms`` (paired differences against
  ``baseline``)."""
  return ml_collections.ConfigDict(
      {
          'metric': metric,
          'arms': tuple(arms),
          'baseline': baseline,
          'title': title or metric,
      }
  )


@dataclasses.dataclass(frozen=True)
class Run:
  """One run of the grid."""

  arm: str
  seed: int
  config: ml_collections.ConfigDict

  @property
  def key(self) -> str:
    return run_key(self.config)


def _globals(path: str) -> dict[str, Any]:
  if not os.path.isfile(path):
    raise FileNotFoundError(
        f'experiment config {path!r} not found; pass a file such as '
        'configs/experiments/init_comparison.py.'
    )
  return runpy.run_path(path)


def expand_paths(paths: Iterable[str]) -> list[str]:
  """``NAME.py[:scale]`` paths without duplicates, suites replaced by their
  experiments."""
  out: list[str] = []
  for entry in paths:
    path, _, arg = entry.partition(':')
    members = _globals(path).get('EXPERIMENTS')
    if members is None:
      out.append(entry)
      continue
    # A suite: its experiments, at the suite's scale argument.
    suffix = f':{arg}' if arg else ''
    for member in members:
      out.append(os.path.join(os.path.dirname(path), member) + suffix)
  return list(dict.fromkeys(out))


def load(path_and_arg: str) -> ml_collections.ConfigDict:
  """The validated ``get_config([arg])`` of
  ``configs/experiments/NAME.py[:arg]``."""
  path, _, arg = path_and_arg.partition(':')
  get_config = _globals(path).get('get_config')
  exp = None
  if get_config is not None and arg:
    exp = get_config(arg)
  elif get_config is not None:
    exp = get_config()
  if not isinstance(exp, ml_collections.ConfigDict) or 'arms' not in exp:
    raise ValueError(
        f'{path} is not an experiment config: its get_config() must return '
        'arms (configs/experiments/NAME.py; a suite defines EXPERIMENTS; '
        'training configs go to train.py).'
    )
  validate(exp)
  return exp


def validate(exp: ml_collections.ConfigDict) -> None:
  """Raises one ``ValueError`` listing every problem of an experiment config."""
  names = [arm.name for arm in exp.arms]
  problems = []
  if exp.scale not in ('cpu', 'accelerator'):
    problems.append(f"scale {exp.scale!r} is not 'cpu' or 'accelerator'")
  if len(set(names)) != len(names):
    problems.append(f'duplicate arm names in {names}')
  if not exp.seeds or len(set(exp.seeds)) != len(exp.seeds):
    problems.append(
        f'seeds must be distinct and non-empty, got {tuple(exp.seeds)}'
    )
  if exp.budget.equalize not in BUDGET_MODES:
    problems.append(
        f'budget.equalize {exp.budget.equalize!r} is not one of'
        f' {BUDGET_MODES}'
    )
  if len(exp.quick_arms) != 2 or any(
      arm not in names for arm in exp.quick_arms
  ):
    problems.append(f'quick_arms must name two arms of {names}')
  for claim in exp.claims:
    if claim.direction not in verdicts.DIRECTIONS:
      problems.append(
          f'claim {claim.id!r}: direction {claim.direction!r} is not one of'
          f' {verdicts.DIRECTIONS}'
      )
    if claim.direction == 'equivalent' and not claim.margin > 0:
      problems.append(
          f'claim {claim.id!r}: an "equivalent" claim needs margin > 0 (the'
          f' largest difference still "similar"), got {claim.margin}'
      )
    if claim.metric.endswith('_minus_mid') and exp.mid_bucket < 1:
      problems.append(
          f'claim {claim.id!r} on {claim.metric} needs mid_bucket, a bucket'
          ' past the first, fixed before the run'
      )
    if claim.get('about_late_rows', False) and (
        verdicts.bucket_contrast(claim.metric) is None
        or claim.direction == 'equivalent'
    ):
      problems.append(
          f'claim {claim.id!r}: about_late_rows needs a "greater" or "less"'
          ' claim on a contrast of the last bucket with another (loss_ or'
          f' excess_late_minus_mid/_early), got {claim.metric}'
          f' ({claim.direction})'
      )
  # (who names it, arm name) of every arm a claim, profile or dose names.
  named = []
  for claim in exp.claims:
    for arm in (claim.arm, claim.baseline):
      if arm:
        named.append((f'claim {claim.id!r}', arm))
  for profile in exp.profiles:
    for arm in (*profile.arms, profile.baseline):
      named.append((f'profile {profile.metric!r}', arm))
  for dose in exp.doses:
    for arm in (*dose.arms, dose.baseline):
      named.append((f'dose {dose.name!r}', arm))
  for owner, arm in named:
    if arm and arm not in names:
      problems.append(f'{owner} names arm {arm!r}, which is not one of {names}')
  if problems:
    raise ValueError(f'experiment {exp.name!r}: ' + '; '.join(problems) + '.')
  # Every override key exists (apply_overrides says which).
  _arm_configs(exp, 'quick')


def apply_overrides(
    config: ml_collections.ConfigDict,
    overrides: Iterable[tuple[str, Any]],
    where: str = '',
) -> ml_collections.ConfigDict:
  """A locked copy of ``config`` with dotted-key ``overrides``; a bad one is a
  ValueError."""
  config = ml_collections.ConfigDict(config.to_dict())
  config.lock()  # An unknown key is an error instead of a new field.
  for key, value in overrides:  # One at a time, so that an error names its key.
    try:
      config.update_from_flattened_dict({key: value})
    except (KeyError, AttributeError, TypeError) as e:
      raise ValueError(
          f'{where}: override {key}={value!r} has the wrong type ({e}).'
          if isinstance(e, TypeError)
          else (
              f'{where}: override {key!r} is not a config '
              'field; see flax_posemb/defaults.py for the valid keys.'
          )
      ) from e
  return config


def _arm_configs(exp: ml_collections.ConfigDict, scale: str) -> dict[str, Any]:
  base = apply_overrides(
      base_config(scale),
      tuple(exp.base_overrides),
      f'experiment {exp.name!r} base_overrides',
  )
  last = tuple(exp.quick_overrides) if scale == 'quick' else ()
  return {
      a.name: apply_overrides(
          base, tuple(a.overrides) + last, f'arm {a.name!r}'
      )
      for a in exp.arms
  }


def expand(exp: ml_collections.ConfigDict, quick: bool = False) -> list[Run]:
  """Every arm at every seed, seed-major (``quick``: ``quick_arms`` at the first
  seed)."""
  arm_configs = _arm_configs(exp, 'quick' if quick else exp.scale)
  arm_names = list(exp.quick_arms) if quick else list(arm_configs)
  return [
      Run(
          name,
          int(seed),
          apply_overrides(
              arm_configs[name], (('seed', int(seed)),), f'arm {name!r}'
          ),
      )
      for seed in exp.seeds[: 1 if quick else None]
      for name in arm_names
  ]


def offsets(exp: ml_collections.ConfigDict, quick: bool) -> tuple[int, ...]:
  """The offset probe's shifts of a sweep (``quick``: of --quick)."""
  if quick and exp.quick_offsets:
    return tuple(int(k) for k in exp.quick_offsets)
  return tuple(int(k) for k in exp.offsets)


def run_key(config: ml_collections.ConfigDict) -> str:
  """12 hex digits of the resolved config minus ``defaults.NON_SEMANTIC``."""
  d = config.to_dict()
  for key in defaults.NON_SEMANTIC:
    *parents, leaf = key.split('.')
    functools.reduce(lambda node, part: node.get(part, {}), parents, d).pop(
        leaf, None
    )
  return hashlib.sha256(
      json.dumps(d, sort_keys=True, default=str).encode()
  ).hexdigest()[:12]
