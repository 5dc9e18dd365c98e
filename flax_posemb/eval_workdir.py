"""The eval command: restore a run's checkpoint, evaluate, write the outputs,
compare runs (docs/DESIGN.md, "Evaluation outputs")."""

from collections.abc import Sequence
import os
from typing import Any

from absl import logging
import ml_collections
import numpy as np

from flax_posemb import checkpointing
from flax_posemb import eval_report
from flax_posemb import evaluation
from flax_posemb import model as model_lib
from flax_posemb import sharding
from flax_posemb import train_step
from flax_posemb import workdir as workdir_lib

# Evaluation options that change the results, in the order they appear in a
# variant's name.
VARIANT_KEYS = (
    'split',
    'policy',
    'window_start',
    'min_doc_len',
    'min_start',
    'num_windows',
    'window_len',
    'bucket_size',
    'bucket_edges',
    'seed',
)


def variant_name(
    step: int | None,
    *,
    offsets: Sequence[int] | None = None,
    analyze: bool = False,
    **overrides,
) -> str:
  """``step_N`` plus every option given
  (``step_400_window_start-deep_offsets-0-64``)."""
  parts = ([] if step is None else [f'step_{step}']) + [
      f"{k}-{str(overrides[k]).replace(',', '-').replace(os.sep, '-')}"
      for k in VARIANT_KEYS
      if overrides.get(k) not in (None, '')
  ]
  if offsets:
    parts.append('offsets-' + '-'.join(str(k) for k in sorted(set(offsets))))
  return '_'.join(parts + (['analyze'] if analyze else []))


def _make_model(config: dict[str, Any]):
  """The model of a stored config; its table comes from the checkpoint, not a
  ``file:``."""
  config = ml_collections.ConfigDict(config)
  if str(config.model.get('position_init', '')).startswith('file:'):
    config.model.position_init = 'zeros'
  if config.model.get('attention_impl') == 'cudnn':
    config.model.attention_impl = 'auto'
  return train_step.make_model(config)


def evaluate_workdir(
    workdir: str,
    *,
    step: int | None = None,
    output: str | None = None,
    offsets: Sequence[int] | None = None,
    analyze: bool = False,
    **overrides,
) -> dict[str, Any]:
  """Evaluates a run's checkpoint (``step``, default the newest readable one)
  into ``output`` (default ``WORKDIR/eval/<variant_name>``), with the table
  analysis if ``analyze``; ``offsets``, ``overrides``:
  `evaluation.run_evaluation`."""
  mesh = sharding.make_mesh()
  # the run whose checkpoint this must be
  run = workdir_lib.saved_config(workdir)
  params, cfg, info = checkpointing.restore_params(
      workdir,
      step,
      sharding=sharding.replicated(mesh),
      expected=None
      if run is None
      else evaluation.expected_params(_make_model(run)),
  )
  step, config = info.step, ml_collections.ConfigDict(cfg)
  if analyze and model_lib.POSITION_TABLE_PATH[0] not in params:
    raise ValueError(
        '--analyze needs a learned position table; this run uses '
        f'position_embedding={config.model.position_embedding!r}.'
    )
  out = evaluation.run_evaluation(
      _make_model(cfg),
      params,
      config,
      step=step,
      offsets=offsets,
      mesh=mesh,
      **overrides,
  )
  out.results.update(
      workdir=os.path.abspath(workdir), step=step, checkpoint=info.to_json()
  )
  out_dir = output or os.path.join(
      workdir,
      'eval',
      variant_name(step, offsets=offsets, analyze=analyze, **overrides),
  )
  title = (
      f'{os.path.basename(os.path.normpath(workdir))}:'
      f' {config.data.position_policy}, {config.model.position_init} init, step'
      f' {step}'
  )
  files = eval_report.write_outputs(
      out.results,
      out.per_position,
      out_dir,
      title=title,
      per_window=out.per_window,
  )
  note = []  # why the checkpoint evaluated is not simply the one asked for
  if info.fell_back_from:
    note.append(
        'skipped damaged '
        + '; '.join(
            f"step {d['step']} ({d['reason']})" for d in info.fell_back_from
        )
    )
  if info.vanished:
    note.append(
        'step(s) '
        + ', '.join(str(k) for k in info.vanished)
        + ' deleted by a running training while being read'
    )
  head = (
      f'evaluated checkpoint step {step}: ' + '; '.join(note) + '.\n'
      if note
      else ''
  )
  text = head + eval_report.format_results(out.results)
  # The drift needs an initial table: the step-0 checkpoint's if no table_0.npy.
  if analyze:
    from flax_posemb import analysis_report  # heavy

    initial, s = None, evaluation.eval_settings(config, overrides)
    if (
        not os.path.exists(os.path.join(workdir, 'tables', 'table_0.npy'))
        and step != 0
    ):
      try:
        initial = np.asarray(
            model_lib.position_table(
                checkpointing.restore_params(workdir, 0)[0]
            )
        )
      except (FileNotFoundError, checkpointing.CheckpointDamagedError) as e:
        logging.warning('No initial table for the drift analysis: %s', e)
    summary = analysis_report.analyze_workdir(
        workdir,
        np.asarray(model_lib.position_table(params)),
        os.path.join(out_dir, 'analysis'),
        step=step,
        initial=initial,
        per_position=out.per_position,
        bucket_size=s['bucket_size'],
        bucket_edges=s['bucket_edges'],
    )
    files.update({f'analysis_{k}': v for k, v in summary['files'].items()})
    text += (
        f"\n\nposition probe R^2 {summary['probe']['r2']:.3f}; table analysis: "
        f"{summary['files']['json']}"
    )
  return {
      'results': out.results,
      'per_window': out.per_window,
      'files': files,
      'out_dir': out_dir,
      'step': step,
      'table': text,
  }


def evaluate_and_compare(
    workdirs: Sequence[str], *, output: str | None = None, **kwargs
) -> tuple[list[tuple[str, dict[str, Any]]], dict | None]:
  """``([(label, evaluate_workdir(run)), ...], comparison)``: for several runs
  `eval_report.compare` plus out_dir (default
  ``compare_<A>_vs_<B>[_<variant>]``), else None."""
  labels = [os.path.basename(os.path.normpath(w)) for w in workdirs]
  if len(set(labels)) < len(labels):
    labels = [os.path.normpath(w).replace(os.sep, '_') for w in workdirs]
  runs = [
      (
          label,
          evaluate_workdir(
              w,
              output=os.path.join(output, label)
              if output and len(workdirs) > 1
              else output,
              **kwargs,
          ),
      )
      for w, label in zip(workdirs, labels)
  ]
  if len(runs) < 2:
    return runs, None
  steps = sorted({r['step'] for _, r in runs})
  variant = variant_name(
      steps[0] if len(steps) == 1 else None,
      **{k: v for k, v in kwargs.items() if k != 'step'},
  )
  name = 'compare_' + '_vs_'.join(labels) + (f'_{variant}' if variant else '')
  out_dir = output or os.path.join(
      os.path.dirname(os.path.normpath(workdirs[0])), name
  )
  comp = eval_report.compare(
      labels,
      [r['results'] for _, r in runs],
      out_dir,
      per_window=[r['per_window'] for _, r in runs],
  )
  return runs, dict(comp, out_dir=out_dir)
