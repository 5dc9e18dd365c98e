"""The eval command: restore a run's checkpoint, evaluate, write the outputs,
compare runs (docs/DESIGN.md § Evaluation outputs)."""

from collections.abc import Sequence
import functools
import os
import tempfile
from typing import Any

from absl import logging
import numpy as np

from flax_posemb import analysis_report
from flax_posemb import checkpointing
from flax_posemb import config as config_lib
from flax_posemb import eval_report
from flax_posemb import evaluation
from flax_posemb import model as model_lib
from flax_posemb import outputs
from flax_posemb import own_tokenizer
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
  parts = []
  if step is not None:
    parts.append(f'step_{step}')
  for key in VARIANT_KEYS:
    value = overrides.get(key)
    if value not in (None, ''):
      text = str(value).replace(',', '-').replace(os.sep, '-')
      parts.append(f'{key}-{text}')
  if offsets:
    parts.append('offsets-' + '-'.join(str(k) for k in sorted(set(offsets))))
  if analyze:
    parts.append('analyze')
  return '_'.join(parts)


def changed_options(
    config: config_lib.RunConfig, overrides: dict[str, Any]
) -> dict[str, Any]:
  """The ``overrides`` whose resolved value differs from the config's own
  (`evaluation.eval_settings`): only these name a variant, so that
  ``--window_start deep`` on a config that is deep already writes the same
  directory as no flag."""
  own = evaluation.eval_settings(config, {})
  given = evaluation.eval_settings(config, overrides)
  changed = {}
  for key, value in overrides.items():
    if value is not None and given.get(key) != own.get(key):
      changed[key] = value
  return changed


def _check_params(
    params: Any, run_config: dict[str, Any], step_dir: str
) -> None:
  """The tree check of an eval.py run, once: the params must fit the model of
  the run's own config (`workdir.run_config`), as on a resume."""
  model = train_step.stored_model(run_config)
  checkpointing.check_model(
      step_dir, 'params', params, evaluation.expected_params(model)
  )


def _initial_table(workdir: str, step: int) -> np.ndarray | None:
  """The table the drift analysis starts from when the run has no
  ``tables/table_0.npy``: the step-0 checkpoint's (None if unreadable)."""
  if step == 0 or os.path.exists(outputs.table_path(workdir, 0)):
    return None
  try:
    params = checkpointing.restore_params(workdir, 0)[0]
  except (FileNotFoundError, checkpointing.CheckpointDamagedError) as e:
    logging.warning('No initial table for the drift analysis: %s', e)
    return None
  return np.asarray(model_lib.position_table(params))


def _checkpoint_note(step: int, info: checkpointing.RestoreInfo) -> str:
  """Why the checkpoint evaluated is not simply the one asked for ('' if it
  is)."""
  notes = []
  if info.fell_back_from:
    skipped = '; '.join(
        f"step {d['step']} ({d['reason']})" for d in info.fell_back_from
    )
    notes.append(f'skipped damaged {skipped}')
  if info.vanished:
    vanished = ', '.join(str(k) for k in info.vanished)
    notes.append(
        f'step(s) {vanished} deleted by a running training while being read'
    )
  if not notes:
    return ''
  return f'evaluated checkpoint step {step}: ' + '; '.join(notes) + '.\n'


def evaluate_workdir(
    workdir: str,
    *,
    step: int | None = None,
    output: str | None = None,
    offsets: Sequence[int] | None = None,
    analyze: bool = False,
    progress: str = '',
    **overrides,
) -> dict[str, Any]:
  """Evaluates a run's checkpoint (``step``, default the newest readable one)
  into ``output`` (default ``WORKDIR/eval/<variant_name>``), with the table
  analysis if ``analyze``; ``offsets``, ``overrides``, ``progress``:
  `evaluation.run_evaluation`."""
  mesh = sharding.make_mesh()
  # Before the newest step is read: a trainer's next one may follow.
  trainer = workdir_lib.held_by(workdir)
  params, stored_config, info = checkpointing.restore_params(
      workdir, step, sharding=sharding.replicated(mesh)
  )
  stored_config = own_tokenizer.resolve_paths(stored_config, workdir)
  step = info.step
  step_dir = os.path.join(checkpointing.checkpoint_dir(workdir), str(step))
  # The run whose checkpoint this must be (without config.json: its oldest
  # checkpoint, never the step read).
  run_config = workdir_lib.run_config(
      workdir, functools.partial(checkpointing.first_config, workdir)
  )
  _check_params(params, run_config, step_dir)
  # The one conversion of the stored config, its model that of
  # `train_step.stored_model`.
  config = config_lib.RunConfig.from_config_dict(
      dict(stored_config, model=train_step.stored_model_fields(stored_config))
  )
  if analyze and model_lib.POSITION_TABLE_PATH[0] not in params:
    raise ValueError(
        '--analyze needs a learned position table; this run uses '
        f'position_embedding={config.model.position_embedding!r}.'
    )
  out = evaluation.run_evaluation(
      train_step.make_model(config),
      params,
      config,
      step=step,
      offsets=offsets,
      mesh=mesh,
      progress=progress,
      **overrides,
  )
  out.results.update(
      workdir=os.path.abspath(workdir), step=step, checkpoint=info.to_json()
  )
  out_dir = output
  if not out_dir:
    variant = variant_name(
        step,
        offsets=offsets,
        analyze=analyze,
        **changed_options(config, overrides),
    )
    out_dir = os.path.join(workdir, outputs.EVAL_DIR, variant)
  run_name = os.path.basename(os.path.normpath(workdir))
  title = (
      f'{run_name}: {config.data.position_policy},'
      f' {config.model.position_init} init, step {step}'
  )
  files = _write_or_keep(out, out_dir, title)
  text = _checkpoint_note(step, info) + eval_report.format_results(out.results)
  if trainer is not None:
    text = (
        f'evaluated step {step}, the newest checkpoint so far: a training'
        f' process ({trainer}) holds {workdir} and writes later steps.\n' + text
    )
  if analyze:
    settings = evaluation.eval_settings(config, overrides)
    summary = analysis_report.analyze_workdir(
        workdir,
        np.asarray(model_lib.position_table(params)),
        os.path.join(out_dir, outputs.ANALYSIS_DIR),
        step=step,
        initial=_initial_table(workdir, step),
        per_position=out.per_position,
        bucket_size=settings['bucket_size'],
        bucket_edges=settings['bucket_edges'],
        progress=bool(progress),
    )
    for key, path in summary['files'].items():
      files[f'analysis_{key}'] = path
    found = '\n'.join(analysis_report.summary_lines(summary))
    text += f"\n\n{found}\ntable analysis: {summary['files']['json']}"
    split = summary.get('init_from_rows')
    if split is not None:
      text += '\n' + _old_and_new_line(split)
  return {
      'results': out.results,
      'per_window': out.per_window,
      'files': files,
      'out_dir': out_dir,
      'step': step,
      'table': text,
      'config': config,
      'options': changed_options(config, overrides),
  }


def _write_or_keep(
    out: evaluation.EvalOutput, out_dir: str, title: str
) -> dict[str, str]:
  """`eval_report.write_outputs` into `out_dir`; if that fails (a disk full
  or a directory gone read-only since eval.py checked it), the results are
  written to a new temporary directory instead and the error names it."""
  try:
    return eval_report.write_outputs(
        out.results,
        out.per_position,
        out_dir,
        title=title,
        per_window=out.per_window,
    )
  except OSError as e:
    kept = tempfile.mkdtemp(prefix='flax_posemb_eval-')
    eval_report.write_outputs(
        out.results,
        out.per_position,
        kept,
        title=title,
        per_window=out.per_window,
    )
    raise OSError(
        e.errno,
        f'{out_dir} could not be written ({e.strerror}); the results are'
        f' kept in {kept}.',
    ) from e


def _old_and_new_line(split: dict[str, Any]) -> str:
  """One line comparing the rows a run took from init_from with its new
  ones."""
  parts = []
  for name in ('old', 'new'):
    group = split[name]
    lo, hi = group['rows']
    values = ', '.join(
        f'{key} {value:.4g}'
        for key, value in group.items()
        if key != 'rows' and value is not None
    )
    parts.append(f'rows {lo}..{hi - 1} ({name}): {values}')
  return (
      f"init_from {split['from']} ({split['new_rows_rule']} new rows): "
      + '; '.join(parts)
  )


def evaluate_and_compare(
    workdirs: Sequence[str],
    *,
    output: str | None = None,
    progress: bool = False,
    **kwargs,
) -> tuple[list[tuple[str, dict[str, Any]]], dict | None]:
  """``([(label, evaluate_workdir(run)), ...], comparison)``: for several runs
  `eval_report.compare` plus out_dir (default
  ``compare_<A>_vs_<B>[_<variant>]``), else None; ``progress``: bars on stderr
  named after each run."""
  labels = [os.path.basename(os.path.normpath(w)) for w in workdirs]
  if len(set(labels)) < len(labels):
    labels = [os.path.normpath(w).replace(os.sep, '_') for w in workdirs]
  runs = []
  for i, (workdir, label) in enumerate(zip(workdirs, labels)):
    run_output = output
    name = label
    if len(workdirs) > 1:
      name = f'{label} (run {i + 1}/{len(workdirs)})'
      if output:
        run_output = os.path.join(output, label)
    run = evaluate_workdir(
        workdir,
        output=run_output,
        progress=name if progress else '',
        **kwargs,
    )
    runs.append((label, run))
  if len(runs) < 2:
    return runs, None
  steps = sorted({run['step'] for _, run in runs})
  common_step = steps[0] if len(steps) == 1 else None
  # The first run's config decides which options are changes.
  options = dict(runs[0][1]['options'])
  for key in ('offsets', 'analyze'):
    if key in kwargs:
      options[key] = kwargs[key]
  variant = variant_name(common_step, **options)
  name = 'compare_' + '_vs_'.join(labels)
  if variant:
    name += f'_{variant}'
  out_dir = output or os.path.join(
      os.path.dirname(os.path.normpath(workdirs[0])), name
  )
  comparison = eval_report.compare(
      labels,
      [run['results'] for _, run in runs],
      out_dir,
      per_window=[run['per_window'] for _, run in runs],
      configs=[own_tokenizer.comparable(run['config']) for _, run in runs],
  )
  return runs, dict(comparison, out_dir=out_dir)
