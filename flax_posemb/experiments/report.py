"""A sweep's summary.json, figures and REPORT.md (docs/DESIGN.md § Experiments
outputs): `aggregate` -> `figures` -> `markdown`."""

from collections.abc import Mapping
import os
from typing import Any

import ml_collections

from flax_posemb import eval_report
from flax_posemb import outputs
from flax_posemb.experiments import aggregate
from flax_posemb.experiments import attribution
from flax_posemb.experiments import figures as figures_lib
from flax_posemb.experiments import markdown
from flax_posemb.experiments import measures
from flax_posemb.experiments import sweep


def write(
    exp: ml_collections.ConfigDict,
    sweep_out: Mapping[str, Any],
    out_dir: str,
    command: str,
) -> dict[str, Any]:
  """Writes ``summary.json``, the figures and ``REPORT.md`` of a sweep.

  Args:
    exp: the experiment's spec.
    sweep_out: `sweep.run_sweep`'s output.
    out_dir: the report directory.
    command: the command the report states.

  Returns:
    The summary.
  """
  summary = dict(aggregate.aggregate(exp, sweep_out), command=command)
  return render(exp, summary, out_dir)


def render(
    exp: ml_collections.ConfigDict, summary: dict[str, Any], out_dir: str
) -> dict[str, Any]:
  """Writes the figures, ``summary.json`` and ``REPORT.md`` of a summary.

  Args:
    exp: the experiment's spec.
    summary: the summary (`aggregate.aggregate`'s, with the ``command``).
    out_dir: the report directory.

  Returns:
    The summary, with its ``figures``.
  """
  figures = figures_lib.write_figures(summary, out_dir)
  summary['figures'] = [name for _, name in figures]
  sweep.write_json(
      os.path.join(out_dir, 'summary.json'), eval_report.json_safe(summary)
  )
  with outputs.atomic_write(os.path.join(out_dir, 'REPORT.md'), 'w') as f:
    f.write(markdown.markdown(exp, summary, figures, out_dir))
  return summary


def rerender(exp: ml_collections.ConfigDict, out_dir: str) -> dict[str, Any]:
  """The summary in ``out_dir`` with what this code adds to it (attribution by
  bucket and the late-rows rule from the summary's own per-bucket profiles;
  n/a where it holds none), rendered again; no run is read.

  Args:
    exp: the experiment's spec.
    out_dir: the report directory holding ``summary.json``.

  Returns:
    The completed summary (not yet written: `render` writes it).
  """
  path = os.path.join(out_dir, 'summary.json')
  if not os.path.isfile(path):
    raise FileNotFoundError(
        f'{path} not found: --rerender renders the reports a sweep wrote; pass'
        ' the --report_dir that sweep wrote (e.g. docs/experiments for the'
        ' committed suites) or run the experiment first.'
    )
  summary = measures.load_json(path)
  doses = summary['analyses'].get('doses', [])
  for dose in doses:
    dose.setdefault(
        'late_full_context_exposure', [float('nan')] * len(dose['arms'])
    )
  attribution.attribute(summary, exp, attribution.from_profiles(summary))
  return summary
