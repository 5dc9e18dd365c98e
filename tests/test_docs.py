"""Every code block of the documentation (docs/*.md and README.md) works.

`python` blocks run: the blocks of one page in order, in one fresh Python
process (a page reads like a notebook: a later block may continue an earlier
one), in an empty working directory, on the CPU. Blocks that read `runs/tiny`
get a workdir trained and evaluated there by a shortened `configs/tiny.py`
(`tiny_run`); those pages are `slow`.

`bash` blocks are commands that train for minutes to months, build datasets
or install packages, so they are not run; each is checked against the
repository instead: the script or module it runs exists, every flag it passes
is one its program defines, every `--config.KEY=...` override names a field
of the config file it loads, and a `pip install -e ".[EXTRA]"` names an extra
of pyproject.toml. A renamed flag, config field, module or extra fails here.
"""

import importlib.util
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The pages of the site and the README; docs/experiments/ and docs/gallery/
# hold generated reports, not documentation pages.
PAGES = sorted((ROOT / 'docs').glob('*.md')) + [ROOT / 'README.md']
# The shortened tiny run of the `runs/tiny` blocks: the files of the real one
# (windows, tables, checkpoints, an evaluation) in about 40 s of CPU.
TINY_OVERRIDES = (
    '--config.num_train_steps=50',
    '--config.eval_every_steps=50',
    '--config.checkpoint_every_steps=50',
    '--config.model.num_layers=1',
    '--config.model.emb_dim=32',
    '--config.model.mlp_dim=64',
    '--config.batch_size=4',
    '--config.eval.num_windows=16',
    '--config.progress_bar=False',
)
# Flags absl defines for every program.
ABSL_FLAGS = frozenset(
    {'help', 'helpfull', 'verbosity', 'v', 'logtostderr', 'alsologtostderr'}
)
# Modules of other projects a command may run (`python3 -m pip ...`).
OTHER_MODULES = frozenset(
    {'pip', 'pytest', 'sphinx', 'pyink', 'ruff', 'mypy', 'venv'}
)
# Programs outside this repository a command may run.
OTHER_PROGRAMS = frozenset({'tensorboard', 'tfds', 'pre-commit', 'source'})
# Runs a page's blocks in order in one namespace; a failure names the
# block's page and line in its traceback.
RUNNER = """
import json, sys
namespace = {'__name__': '__main__'}
for name, code in json.load(open(sys.argv[1])):
  exec(compile(code, name, 'exec'), namespace)
"""


def code_blocks(path: pathlib.Path, language: str) -> list[tuple[int, str]]:
  """(line of the opening fence, code) of each ```LANGUAGE block of `path`."""
  text = path.read_text()
  blocks = []
  for match in re.finditer(rf'^```{language}\n(.*?)^```', text, re.S | re.M):
    line = text.count('\n', 0, match.start()) + 1
    blocks.append((line, match.group(1)))
  return blocks


def run_blocks(
    named_blocks: list[tuple[str, str]], cwd: pathlib.Path
) -> subprocess.CompletedProcess:
  """Runs `(name, code)` blocks in order in one CPU-only Python process."""
  blocks_file = cwd / '.blocks.json'
  blocks_file.write_text(json.dumps(named_blocks))
  env = dict(os.environ, JAX_PLATFORMS='cpu', MPLBACKEND='Agg')
  env['PYTHONPATH'] = os.pathsep.join([str(ROOT), env.get('PYTHONPATH', '')])
  return subprocess.run(
      [sys.executable, '-c', RUNNER, str(blocks_file)],
      cwd=cwd,
      env=env,
      capture_output=True,
      text=True,
      timeout=900,
  )


def _python_pages() -> list:
  params = []
  for page in PAGES:
    blocks = code_blocks(page, 'python')
    if not blocks:
      continue
    needs_run = any('runs/tiny' in code for _, code in blocks)
    marks = [pytest.mark.slow] if needs_run else []
    name = str(page.relative_to(ROOT))
    params.append(pytest.param(page, needs_run, id=name, marks=marks))
  return params


@pytest.fixture(scope='session')
def tiny_run(tmp_path_factory) -> pathlib.Path:
  """A workdir of the shortened tiny config, trained and evaluated."""
  workdir = tmp_path_factory.mktemp('docs_run') / 'tiny'
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  train = [
      sys.executable,
      str(ROOT / 'train.py'),
      '--config',
      str(ROOT / 'configs' / 'tiny.py'),
      '--workdir',
      str(workdir),
      *TINY_OVERRIDES,
  ]
  subprocess.run(train, check=True, env=env, capture_output=True)
  evaluate = [
      sys.executable,
      str(ROOT / 'eval.py'),
      '--workdir',
      str(workdir),
      '--num_windows',
      '16',
  ]
  subprocess.run(evaluate, check=True, env=env, capture_output=True)
  return workdir


@pytest.mark.parametrize('page,needs_run', _python_pages())
def test_python_blocks_of_the_page_run(page, needs_run, tmp_path, request):
  if needs_run:
    (tmp_path / 'runs').mkdir()
    (tmp_path / 'runs' / 'tiny').symlink_to(request.getfixturevalue('tiny_run'))
  name = page.relative_to(ROOT)
  named = [
      (f'{name}:{line}', code) for line, code in code_blocks(page, 'python')
  ]
  done = run_blocks(named, tmp_path)
  assert done.returncode == 0, done.stderr[-4000:]


def test_a_broken_block_fails_and_names_its_page_and_line(tmp_path):
  named = [('page.md:3', 'x = 1\n'), ('page.md:9', 'print(x)\nx.no_such\n')]
  done = run_blocks(named, tmp_path)
  assert done.returncode != 0
  assert 'page.md:9' in done.stderr
  assert 'AttributeError' in done.stderr


def test_the_readme_own_loop_example_is_among_the_blocks_run():
  blocks = code_blocks(ROOT / 'README.md', 'python')
  assert any('PositionStatistics' in code for _, code in blocks)


def test_ci_builds_the_docs_with_warnings_as_errors():
  ci_lines = (ROOT / '.ci' / 'run').read_text().splitlines()
  build = [line for line in ci_lines if line.startswith('python3 -m sphinx')]
  assert build == [
      'python3 -m sphinx -W --keep-going -q -b html docs docs/_build/html'
  ]
  # before the tests, so a docs warning fails CI early
  assert ci_lines.index(build[0]) < ci_lines.index('python3 -m pytest -q -n 2')


# ---- the API reference ----

# Modules that are programs: importing them defines their absl flags, and two
# of them define the same flag (`--config`), so they are documented by
# `--help` and the pages that run them, not in the API reference.
PROGRAMS = frozenset(
    {
        'flax_posemb.commands.data_report',
        'flax_posemb.commands.import_hf',
        'flax_posemb.commands.prepare',
        'flax_posemb.experiments.__main__',
        'flax_posemb.gallery',
    }
)


def package_modules() -> list[str]:
  names = []
  for path in sorted((ROOT / 'flax_posemb').rglob('*.py')):
    parts = list(path.relative_to(ROOT).with_suffix('').parts)
    if parts[-1] == '__init__':
      parts.pop()
    names.append('.'.join(parts))
  return names


def api_modules() -> set[str]:
  text = (ROOT / 'docs' / 'api.md').read_text()
  return set(re.findall(r'^   (flax_posemb[\w.]*)$', text, re.M))


def test_the_api_reference_lists_every_module_but_the_programs():
  modules = set(package_modules()) - PROGRAMS
  assert modules == api_modules()


def test_every_public_function_and_class_has_a_docstring():
  # autodoc shows only documented members: a public name without a docstring
  # would be missing from the API reference without a warning.
  check = """
import importlib, inspect, sys
missing = []
for name in sys.argv[1:]:
  module = importlib.import_module(name)
  for attr, obj in vars(module).items():
    if attr.startswith('_') or getattr(obj, '__module__', None) != name:
      continue
    if not (inspect.isfunction(obj) or inspect.isclass(obj)):
      continue
    if not inspect.getdoc(obj):
      missing.append(f'{name}.{attr}')
    if inspect.isclass(obj):
      for member, value in vars(obj).items():
        public = not member.startswith('_')
        if public and inspect.isfunction(value) and not inspect.getdoc(
            getattr(obj, member)):
          missing.append(f'{name}.{attr}.{member}')
print('\\n'.join(missing))
"""
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  done = subprocess.run(
      [sys.executable, '-c', check, *sorted(api_modules())],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      check=True,
  )
  assert not done.stdout.strip(), done.stdout


# ---- bash blocks: commands checked against the repository ----


def commands(code: str) -> list[list[str]]:
  """The commands of a bash block: continuation lines joined, comments and
  `&&` chains split, each as its words."""
  joined = code.replace('\\\n', ' ')
  result = []
  for line in joined.splitlines():
    words = shlex.split(line, comments=True)
    command: list[str] = []
    for word in words + ['&&']:
      if word == '&&':
        if command:
          result.append(command)
        command = []
      else:
        command.append(word)
  return result


def program_file(words: list[str]) -> pathlib.Path | None:
  """The file of this repository a `python3` command runs (None: another
  project's module)."""
  if words[1] != '-m':
    return ROOT / words[1]
  module = words[2]
  if module.split('.')[0] in OTHER_MODULES:
    return None
  base = ROOT / module.replace('.', '/')
  if (base / '__main__.py').exists():
    return base / '__main__.py'
  return base.with_suffix('.py')


def defined_flags(path: pathlib.Path) -> set[str]:
  """Flags a program defines (absl `DEFINE_*('NAME'` or argparse
  `add_argument('--NAME'`), the shared `--debug` and absl's own."""
  text = path.read_text()
  names = set(re.findall(r"DEFINE_\w+\(\s*'(\w+)'", text))
  names |= set(re.findall(r"add_argument\(\s*'--([\w-]+)'", text))
  return names | {'debug'} | ABSL_FLAGS


def config_fields(spec: str) -> set[str]:
  """Dotted names of every field of the config `FILE[:ARG]` loads. ARG (a
  workdir to start from, a scale) sets values, not fields, and names
  directories of the reader's machine, so the file's default is read."""
  path = spec.partition(':')[0]
  module_spec = importlib.util.spec_from_file_location(
      'doc_config', ROOT / path
  )
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  config = module.get_config()
  return set(_flat_keys(config.to_dict()))


def _flat_keys(tree: dict, prefix: str = '') -> list[str]:
  keys = []
  for key, value in tree.items():
    keys.append(prefix + key)
    if isinstance(value, dict):
      keys += _flat_keys(value, prefix + key + '.')
  return keys


def check_command(words: list[str]) -> list[str]:
  """What is wrong with one documented command ([] if nothing)."""
  if words[0] == 'bash':
    return [] if (ROOT / words[1]).exists() else [f'no file {words[1]}']
  if words[0] in OTHER_PROGRAMS:
    return []
  if words[0] != 'python3':
    return [f'unknown program {words[0]!r}']
  if words[1:3] == ['-m', 'pip']:
    return check_pip(words)
  path = program_file(words)
  if path is None:
    return []
  if not path.exists():
    return [f'no program {path.relative_to(ROOT)}']
  problems = []
  flags = defined_flags(path)
  config = None
  for i, word in enumerate(words):
    if not word.startswith('--'):
      continue
    name, _, value = word[2:].partition('=')
    if name == 'config' and not value and i + 1 < len(words):
      config = words[i + 1]
    if name.startswith('config.'):
      continue
    if name.removeprefix('no') not in flags and name not in flags:
      problems.append(f'{path.name} defines no flag --{name}')
  overrides = [w[len('--config.') :].split('=')[0] for w in words]
  overrides = [o for o, w in zip(overrides, words) if w.startswith('--config.')]
  if overrides:
    if config is None:
      return problems + ['--config.KEY overrides without --config FILE']
    fields = config_fields(config)
    problems += [f'no config field {o}' for o in overrides if o not in fields]
  return problems


def check_pip(words: list[str]) -> list[str]:
  """A `pip install -e ".[EXTRA,...]"` names extras pyproject.toml has."""
  pyproject = tomllib.loads((ROOT / 'pyproject.toml').read_text())
  extras = set(pyproject['project']['optional-dependencies'])
  problems = []
  for word in words:
    match = re.fullmatch(r'\.\[([\w,]+)\]', word)
    if match:
      problems += [
          f'no extra {e!r} in pyproject.toml'
          for e in match.group(1).split(',')
          if e not in extras
      ]
  return problems


def _bash_blocks() -> list:
  params = []
  for page in PAGES:
    for line, code in code_blocks(page, 'bash'):
      name = f'{page.relative_to(ROOT)}:{line}'
      params.append(pytest.param(code, id=name))
  return params


@pytest.mark.parametrize('code', _bash_blocks())
def test_bash_commands_use_programs_flags_and_fields_that_exist(code):
  problems = [p for words in commands(code) for p in check_command(words)]
  assert not problems, problems


def test_the_command_check_refuses_unknown_flags_fields_and_programs():
  bad = (
      'python3 train.py --config configs/tiny.py --workdir w --no_such_flag\n'
      'python3 train.py --config configs/tiny.py --config.data.no_such=1\n'
      'python3 -m flax_posemb.commands.no_such_command --x 1\n'
      'python3 -m pip install -e ".[no_such_extra]"\n'
  )
  problems = [check_command(words) for words in commands(bad)]
  assert all(problems), problems
  good = 'python3 train.py --config configs/tiny.py --config.data.seq_len=64'
  assert check_command(commands(good)[0]) == []


def test_the_docs_site_wraps_long_code_lines():
  """sphinx-book-theme cuts a long command at a 1280-px window: the site adds
  a stylesheet that wraps code blocks' lines."""
  conf = ROOT / 'docs' / 'conf.py'
  namespace: dict = {'__file__': str(conf)}
  exec(conf.read_text(), namespace)
  (static,) = namespace['html_static_path']
  sheets = [
      ROOT / 'docs' / static / name for name in namespace['html_css_files']
  ]
  css = ' '.join(sheet.read_text() for sheet in sheets)
  assert re.search(r'div\.highlight pre[^{]*\{[^}]*white-space: pre-wrap', css)
