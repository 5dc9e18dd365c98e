"""Experiment configs: loading, arm overrides, and the paired grid of runs (arms x seeds).

An experiment config (``configs/experiments/NAME.py``, ``get_config(scale='cpu')``) is an
``ml_collections.ConfigDict`` with:

* ``name``, ``title``, ``question``: identification and the question in one paragraph;
* ``scale``: 'cpu' | 'accelerator' (the base training config, ``scales.base_config``);
* ``base_overrides``: dotted-key overrides applied to the base config for every arm;
* ``arms``: tuple of ``arm(name, overrides)``;
* ``seeds``: tuple of ints; seed ``s`` of every arm shares data order and model init;
* ``claims``: tuple of ``claim(...)`` judged by the fixed rule of ``paired.verdict``;
* ``budget``: how arms are given the same real tokens per step (``budget.py``);
* ``profiles``: per-bucket comparisons (``profile(...)``) to tabulate and plot;
* ``analyses``: cross-arm analyses, e.g. ``('cosine_convergence',)``;
* ``convergence_threshold``: agreement level for 'cosine_convergence';
* ``offsets``: offset-probe shifts, e.g. ``(0, 16)``; empty for none;
* ``quick_arms``: the two arms ``--quick`` runs (one seed, ``scales.base_config('quick')``);
* ``quick_overrides``: applied last under ``--quick`` (shrinks what ``base_overrides`` set);
* ``rare_exposure``: rows seen fewer times than this count as "rare" (where the penalty sits);
* ``notes``: what changed since the previous committed report (REPORT.md lists them first).

``new(...)`` returns such a config with every field at its default.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
from typing import Any, Iterable, Mapping

import ml_collections

from flax_posemb import defaults
from flax_posemb.experiments import paired, scales

# Fields that do not change what a run computes: excluded from its identity (run key).
_NON_SEMANTIC = defaults.NON_SEMANTIC


def new(name: str, title: str, question: str, scale: str = 'cpu') -> ml_collections.ConfigDict:
  """An experiment config with every field at its default (fill arms, claims, ...)."""
  if scale not in ('cpu', 'accelerator'):
    raise ValueError(f"experiment scale must be 'cpu' or 'accelerator', got {scale!r}.")
  c = ml_collections.ConfigDict()
  c.name = name
  c.title = title
  c.question = question
  c.scale = scale
  c.base_overrides = ()
  c.arms = ()
  c.seeds = (0, 1, 2, 3, 4)
  c.claims = ()
  c.profiles = ()
  c.analyses = ()
  c.convergence_threshold = 0.9
  c.offsets = ()
  c.quick_arms = ()
  c.quick_overrides = ()  # Applied after the arm's overrides under --quick.
  c.rare_exposure = 100.0
  c.report_scalars = ()  # Extra per-arm scalars tabulated in REPORT.md.
  c.notes = ()  # What changed since the previous committed report.
  c.budget = ml_collections.ConfigDict({
      'equalize': 'real_tokens',  # real_tokens | none (see flax_posemb/experiments/budget.py).
      'target_tokens_per_step': float(scales.TARGET_TOKENS_PER_STEP[scale]),  # <=0: reference arm's.
      'reference_arm': '',  # Arm keeping the base batch size when no target is set.
      'estimate_batches': 20})  # Batches drawn to measure scored tokens per row.
  return c


def arm(name: str, overrides: Mapping[str, Any] | None = None,
        label: str = '') -> ml_collections.ConfigDict:
  """One arm: a name and dotted-key overrides of the training config.

  Args:
    name: identifier used in claims, tables and plots ('packed', 'stdlib/natural', ...).
    overrides: e.g. ``{'data.position_policy': 'packed'}``.
    label: optional longer description for the report.

  Returns:
    ConfigDict ``{name, label, overrides: ((key, value), ...)}``.
  """
  pairs = tuple((str(k), v) for k, v in (overrides or {}).items())
  return ml_collections.ConfigDict({'name': name, 'label': label or name, 'overrides': pairs})


def claim(claim_id: str, text: str, metric: str, arm_name: str, baseline: str,
          direction: str, margin: float = 0.0) -> ml_collections.ConfigDict:
  """A claim judged on the paired difference ``metric(arm) - metric(baseline)``.

  Args:
    claim_id: short identifier.
    text: the claim in words, as the report states it.
    metric: a per-run scalar measure (``measures.SCALARS``).
    arm_name: the arm predicted to differ.
    baseline: the arm it is compared with (same seeds); '' compares the arm's value with 0.
    direction: 'greater' / 'less' (predicted sign of the difference) or 'equivalent'.
    margin: half-width of the equivalence band (metric units), for 'equivalent'.

  Returns:
    ConfigDict with those fields.
  """
  if direction not in paired.DIRECTIONS:
    raise ValueError(f'claim {claim_id!r}: direction {direction!r} is not one of '
                     f'{paired.DIRECTIONS}.')
  return ml_collections.ConfigDict({
      'id': claim_id, 'text': text, 'metric': metric, 'arm': arm_name, 'baseline': baseline,
      'direction': direction, 'margin': float(margin)})


def profile(metric: str, arms: Iterable[str], baseline: str = '',
            title: str = '') -> ml_collections.ConfigDict:
  """A per-bucket comparison: ``metric`` (a ``measures.VECTORS`` name) across ``arms``.

  With a ``baseline``, the report also gives the per-bucket paired difference of each arm
  against it with 95% intervals (where the penalty sits).
  """
  return ml_collections.ConfigDict({'metric': metric, 'arms': tuple(arms),
                                    'baseline': baseline, 'title': title or metric})


@dataclasses.dataclass(frozen=True)
class Run:
  """One training run of the grid.

  Attributes:
    arm: arm name.
    seed: seed shared by all arms (data order and model init).
    config: resolved training config (locked).
  """
  arm: str
  seed: int
  config: ml_collections.ConfigDict

  @property
  def key(self) -> str:
    return run_key(self.config)


def _module(path: str):
  if not os.path.isfile(path):
    raise FileNotFoundError(f'experiment config {path!r} not found; pass a file such as '
                            'configs/experiments/init_comparison.py.')
  module_spec = importlib.util.spec_from_file_location('_experiment_config', path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module


def expand_paths(paths: Iterable[str]) -> list[str]:
  """Experiment config paths, with suite files replaced by the experiments they list.

  A suite file (e.g. ``configs/experiments/all.py``) defines ``EXPERIMENTS``, a tuple of
  experiment config file names relative to the suite file's directory; a ``:scale`` suffix
  on the suite is passed on to each of them.

  Args:
    paths: ``configs/experiments/NAME.py[:scale]`` entries.

  Returns:
    Experiment config paths (``path[:scale]``), in order, without duplicates.
  """
  out: list[str] = []
  for entry in paths:
    path, _, arg = entry.partition(':')
    module = _module(path)
    members = [entry]
    if hasattr(module, 'EXPERIMENTS'):
      files = [os.path.join(os.path.dirname(path), m) for m in module.EXPERIMENTS]
      members = [f'{m}:{arg}' if arg else m for m in files]
    out += [m for m in members if m not in out]
  return out


def load(path_and_arg: str) -> ml_collections.ConfigDict:
  """Loads ``get_config([arg])`` from ``configs/experiments/NAME.py[:arg]``.

  Args:
    path_and_arg: file path, optionally followed by ``:scale`` (e.g. ``:accelerator``).

  Returns:
    The experiment config, validated.
  """
  path, _, arg = path_and_arg.partition(':')
  module = _module(path)
  if not hasattr(module, 'get_config'):
    raise ValueError(f'{path} defines no get_config() (a suite of experiments defines '
                     'EXPERIMENTS; run it through python -m flax_posemb.experiments).')
  exp = module.get_config(arg) if arg else module.get_config()
  if 'arms' not in exp:
    raise ValueError(f'{path} is not an experiment config (its get_config() defines no arms); '
                     'pass configs/experiments/NAME.py. Training configs go to train.py.')
  validate(exp)
  return exp


def validate(exp: ml_collections.ConfigDict) -> None:
  """Checks names, seeds and claims of an experiment config; raises ``ValueError``."""
  names = [a.name for a in exp.arms]
  if len(set(names)) != len(names):
    raise ValueError(f'experiment {exp.name!r}: duplicate arm names in {names}.')
  if len(set(exp.seeds)) != len(exp.seeds) or not exp.seeds:
    raise ValueError(f'experiment {exp.name!r}: seeds must be distinct and non-empty, got '
                     f'{tuple(exp.seeds)}.')
  for c in exp.claims:
    for a in (c.arm, c.baseline):
      if a and a not in names:
        raise ValueError(f'claim {c.id!r} names arm {a!r}, which is not one of {names}.')
    paired.verdict(paired.t_interval([]), c.direction, c.margin)  # Validates the rule.
  for p in exp.profiles:
    for a in tuple(p.arms) + ((p.baseline,) if p.baseline else ()):
      if a not in names:
        raise ValueError(f'profile {p.metric!r} names arm {a!r}, which is not one of {names}.')
  if len(exp.quick_arms) != 2 or any(a not in names for a in exp.quick_arms):
    raise ValueError(f'experiment {exp.name!r}: quick_arms must name two arms of {names}.')
  for _, c in _arm_configs(exp, 'quick'):  # Every override key exists.
    del c


def apply_overrides(config: ml_collections.ConfigDict, overrides: Iterable[tuple[str, Any]],
                    where: str = '') -> ml_collections.ConfigDict:
  """A locked copy of ``config`` with dotted-key ``overrides`` set
  (``ConfigDict.update_from_flattened_dict``, which type-checks: an int may widen to a float
  field, nothing else changes type).

  Args:
    config: training config.
    overrides: ``(dotted_key, value)`` pairs, applied in order.
    where: context for error messages (e.g. "arm 'packed'").

  Returns:
    A new locked config.

  Raises:
    ValueError: naming ``where`` and the key, for a key that is not a config field or a value
      of the wrong type.
  """
  config = ml_collections.ConfigDict(config.to_dict())
  config.lock()  # Locked: an unknown key is an error instead of a new field.
  for key, value in overrides:  # One at a time, so that an error names its key.
    try:
      config.update_from_flattened_dict({key: value})
    except (KeyError, AttributeError) as e:
      raise ValueError(f'{where}: override {key!r} is not a config field; see '
                       'flax_posemb/defaults.py for the valid keys.') from e
    except TypeError as e:
      raise ValueError(f'{where}: override {key}={value!r} has the wrong type ({e}).') from e
  return config


def _arm_configs(exp: ml_collections.ConfigDict, scale: str):
  base = apply_overrides(scales.base_config(scale), tuple(exp.base_overrides),
                         f'experiment {exp.name!r} base_overrides')
  last = tuple(exp.quick_overrides) if scale == 'quick' else ()
  for a in exp.arms:
    yield a.name, apply_overrides(base, tuple(a.overrides) + last, f'arm {a.name!r}')


def expand(exp: ml_collections.ConfigDict, quick: bool = False) -> list[Run]:
  """The paired grid: every arm at every seed, seed-major (all arms of seed 0 first).

  ``config.seed`` (model init, dropout and data order) and, for the synthetic corpus, the
  corpus seed are shared by all arms at a seed, so arms differ only by their overrides.

  Args:
    exp: experiment config.
    quick: two ``quick_arms``, the first seed, the 'quick' scale.

  Returns:
    Runs, seed-major, arms in config order.
  """
  scale = 'quick' if quick else exp.scale
  arm_configs = dict(_arm_configs(exp, scale))
  arm_names = list(exp.quick_arms) if quick else [a.name for a in exp.arms]
  seeds = list(exp.seeds)[:1] if quick else list(exp.seeds)
  runs = []
  for seed in seeds:
    for name in arm_names:
      runs.append(Run(name, int(seed), apply_overrides(arm_configs[name], (('seed', int(seed)),),
                                                       f'arm {name!r}')))
  return runs


def run_key(config: ml_collections.ConfigDict) -> str:
  """Identity of a run: a hash of its resolved config minus non-semantic fields.

  Two arms (in one experiment or in several sharing a run store) with the same key are
  the same computation and are trained once.

  Args:
    config: resolved training config.

  Returns:
    12 hex digits.
  """
  d = config.to_dict()
  for key in _NON_SEMANTIC:
    node = d
    parts = key.split('.')
    for part in parts[:-1]:
      node = node.get(part, {})
    node.pop(parts[-1], None)
  blob = json.dumps(d, sort_keys=True, default=str)
  return hashlib.sha256(blob.encode()).hexdigest()[:12]
