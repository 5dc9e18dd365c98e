"""Paired sweeps of runs, their measures and reports (docs/DESIGN.md
§ Experiments outputs)."""

import collections
import glob
import logging
import os
import shlex
import sys
from typing import Any

from flax_posemb import outputs
from flax_posemb.experiments import figures
from flax_posemb.experiments import measures
from flax_posemb.experiments import report
from flax_posemb.experiments import spec
from flax_posemb.experiments import sweep
from flax_posemb.experiments import verdicts
from flax_posemb.experiments.spec import arm
from flax_posemb.experiments.spec import claim
from flax_posemb.experiments.spec import expand
from flax_posemb.experiments.spec import load
from flax_posemb.experiments.spec import profile
from flax_posemb.experiments.verdicts import judge
from flax_posemb.experiments.verdicts import verdict
from flax_posemb.experiments.verdicts import with_holm
from flax_posemb.inference import t_interval

__all__ = [
    'arm',
    'claim',
    'expand',
    'judge',
    'load',
    'profile',
    'run_experiment',
    'rerender_suite',
    'run_suite',
    't_interval',
    'verdict',
    'with_holm',
]
logger = logging.getLogger(__name__)


def _command(command: str) -> str:
  return command or 'python -m flax_posemb.experiments ' + ' '.join(
      shlex.quote(a) for a in sys.argv[1:]
  )


def run_experiment(
    config_path: str,
    workdir: str,
    *,
    report_dir: str = '',
    command: str = '',
    **sweep_kwargs: Any,
) -> dict[str, Any]:
  """Runs (or resumes, `sweep.run_sweep` with ``sweep_kwargs``)
  ``NAME.py[:scale]`` and writes its report into ``report_dir`` ('' =
  ``workdir``), stating ``command`` ('' = this argv)."""
  exp = spec.load(config_path)
  out = sweep.run_sweep(exp, workdir, **sweep_kwargs)
  summary = report.write(exp, out, report_dir or workdir, _command(command))
  logger.info('report: %s', os.path.join(report_dir or workdir, 'REPORT.md'))
  return summary


def run_suite(
    config_paths: list[str],
    workdir: str,
    *,
    run_store: str = '',
    report_dir: str = '',
    max_runs: int = -1,
    command: str = '',
    **sweep_kwargs: Any,
) -> dict[str, dict[str, Any]]:
  """name -> summary of experiments sharing one run store (``max_runs`` counts
  over all)."""
  store = run_store or os.path.join(workdir, 'store')
  os.makedirs(store, exist_ok=True)
  out_root = report_dir or workdir
  command = _command(command)

  def count_done():
    return sum(sweep.is_done(os.path.join(store, d)) for d in os.listdir(store))

  summaries: dict[str, dict[str, Any]] = {}
  for path in spec.expand_paths(config_paths):
    name = spec.load(path).name
    before = count_done()
    summaries[name] = run_experiment(
        path,
        os.path.join(workdir, name),
        run_store=store,
        report_dir=os.path.join(out_root, name),
        max_runs=max_runs,
        command=command,
        **sweep_kwargs,
    )
    if max_runs >= 0:
      max_runs = max(0, max_runs - (count_done() - before))
  finish_suite(config_paths, summaries, out_root)
  return summaries


def suite_name(config_paths: list[str]) -> str:
  """The name a suite run states: its config files' names."""
  return ' + '.join(
      os.path.basename(path.partition(':')[0]) for path in config_paths
  )


def finish_suite(
    config_paths: list[str],
    summaries: dict[str, dict[str, Any]],
    out_root: str,
) -> None:
  """Holm over every claim of the suite (`verdicts.with_suite_holm`), each
  report rewritten with it, and the index.

  Args:
    config_paths: the suite's config paths, as given.
    summaries: name -> summary of the suite's experiments (in place).
    out_root: the reports' root (``out_root/NAME/``).
  """
  verdicts.with_suite_holm(summaries, suite_name(config_paths))
  for path in spec.expand_paths(config_paths):
    exp = spec.load(path)
    report.render(exp, summaries[exp.name], os.path.join(out_root, exp.name))
  write_index(summaries, out_root, '')


def rerender_suite(config_paths: list[str], out_root: str) -> None:
  """Renders a suite's committed reports again from their ``summary.json``
  (`report.rerender`), with the suite-wide Holm and the index; trains
  nothing. A single experiment's report is ``out_root`` itself (as
  `run_experiment` writes it), without a suite.

  Args:
    config_paths: the suite's config paths (e.g. configs/experiments/all.py).
    out_root: the reports' root (``out_root/NAME/summary.json``).
  """
  paths = spec.expand_paths(config_paths)
  if paths == list(config_paths) and len(paths) == 1:
    # One experiment: its report is out_root itself, and it has no suite.
    exp = spec.load(paths[0])
    report.render(exp, report.rerender(exp, out_root), out_root)
    return
  summaries = {}
  for path in paths:
    exp = spec.load(path)
    summaries[exp.name] = report.rerender(exp, os.path.join(out_root, exp.name))
  finish_suite(config_paths, summaries, out_root)


def _verdict_counts(claims: list[dict[str, Any]], key: str) -> str:
  """'N verdict, ...' of the claims' `key` ('verdict' or 'verdict_holm')."""
  counts = collections.Counter(c[key] for c in claims)
  return ', '.join(f'{n} {v}' for v, n in counts.items()) or 'no claims'


def _all_summaries(
    summaries: dict[str, dict[str, Any]], out_dir: str
) -> dict[str, dict[str, Any]]:
  """Every report's summary in ``out_dir`` (other suites' too), ``summaries``
  replacing theirs; by experiment name."""
  found = {}
  for path in sorted(glob.glob(os.path.join(out_dir, '*', 'summary.json'))):
    name = os.path.basename(os.path.dirname(path))
    found[name] = measures.load_json(path)
  found.update(summaries)
  return dict(sorted(found.items()))


def _suite_counts(summary: dict[str, Any]) -> str:
  """The verdict counts after the suite-wide Holm of a report's suite."""
  suite = summary['multiplicity'].get('suite')
  if not suite:
    return 'suite-wide Holm: n/a (not written by a suite run)'
  counts = _verdict_counts(summary['claims'], 'verdict_holm_suite')
  return f'after Holm over the suite `{suite["name"]}`: {counts}'


def _suite_lines(everything: dict[str, dict[str, Any]]) -> list[str]:
  """One line per suite run behind the reports: its experiments and its
  claims before and after the suite-wide Holm-Bonferroni."""
  suites = {}
  for s in everything.values():
    suite = s['multiplicity'].get('suite')
    if suite:
      suites[suite['name']] = suite
  lines = []
  for name, suite in suites.items():
    # A member rendered since without this suite (run alone, or by another
    # suite) holds no verdicts of this suite's Holm.
    stale = [
        experiment
        for experiment in suite['experiments']
        if everything.get(experiment, {}).get('multiplicity', {}).get('suite')
        != suite
    ]
    if stale:
      lines.append(
          f'- Suite `{name}` ({", ".join(suite["experiments"])}): its'
          f' suite-wide Holm is out of date ({", ".join(stale)} rendered'
          ' since without it); run the suite again, or --rerender it.'
      )
      continue
    claims = [
        claim
        for experiment in suite['experiments']
        for claim in everything.get(experiment, {}).get('claims', [])
    ]
    lines.append(
        f'- Suite `{name}` ({", ".join(suite["experiments"])}):'
        f' {suite["claims_tested"]} claims tested; by the verdict rule'
        ' (the late-rows rule included)'
        f' {_verdict_counts(claims, "verdict")}; after Holm within each'
        f' experiment {_verdict_counts(claims, "verdict_holm")}; after Holm'
        ' over the whole suite'
        f' {_verdict_counts(claims, "verdict_holm_suite")}.'
    )
  if not lines:
    return []
  return [
      (
          'Multiplicity: each report applies Holm-Bonferroni over its own'
          ' claims and over all claims of the suite run that wrote it'
          ' (family-wise error 5%).'
      ),
      '',
      *lines,
      '',
  ]


def write_index(
    summaries: dict[str, dict[str, Any]], out_dir: str, command: str
) -> str:
  """Writes ``out_dir/README.md``: every report in ``out_dir`` (this suite's
  and earlier ones'), its verdict counts and links, and the dose-response
  series of all of them in one figure; returns its path."""
  del command  # Each report states its own.
  everything = _all_summaries(summaries, out_dir)
  lines = [
      '# Experiments',
      '',
      (
          'Each report states the command that produced it; experiments of one'
          ' command share one run store (arms whose resolved configs coincide'
          ' are one run).'
      ),
      '',
  ]
  doses = [
      dict(d, name=f'{name}: {d["name"]}')
      for name, s in everything.items()
      for d in s['analyses'].get('doses', [])
      if d['arms']
  ]
  if doses:
    title, figure = figures.dose_plot(doses, out_dir, 'every experiment')
    lines += [f'![{title}]({figure})', '']
  lines += _suite_lines(everything)
  for name, s in everything.items():
    partial = '' if s['complete'] else ' **(partial sweep)**'
    lines += [
        f'## [{s["title"]}]({name}/REPORT.md){partial}',
        '',
        s['question'],
        '',
        (
            f'Verdicts: {_verdict_counts(s["claims"], "verdict")}'
            f' ({s["multiplicity"]["claims_tested"]} claims tested; after'
            ' Holm-Bonferroni:'
            f' {_verdict_counts(s["claims"], "verdict_holm")};'
            f' {_suite_counts(s)}). Data:'
            f' [`summary.json`]({name}/summary.json). Command:'
            f' `{s.get("command", "")}`.'
        ),
        '',
        f'![{name}]({name}/{s["figures"][0]})',
        '',
    ]
  path = os.path.join(out_dir, 'README.md')
  with outputs.atomic_write(path, 'w') as f:
    f.write('\n'.join(lines))
  return path
