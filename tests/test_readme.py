"""The README is the user's truth: CI must run exactly its install and test
commands."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _quickstart_commands() -> list[str]:
  text = (ROOT / 'README.md').read_text()
  section = text.split('## Quickstart', 1)[1]
  block = re.search(r'```bash\n(.*?)```', section, re.S).group(1)
  return [line.strip() for line in block.splitlines() if line.strip()]


def test_ci_runs_the_readme_install_and_test_commands_verbatim():
  """Every Quickstart command that installs (pip) or tests (pytest) is a line
  of `.ci/run`, so what the README tells a user is what CI checks."""
  commands = _quickstart_commands()
  installs = [c for c in commands if c.startswith('python3 -m pip install')]
  tests = [c for c in commands if c.startswith('python3 -m pytest')]
  assert installs and tests, commands
  ci_lines = [
      line.strip() for line in (ROOT / '.ci' / 'run').read_text().splitlines()
  ]
  for command in installs + tests:
    assert command in ci_lines, command
  assert 'set -euo pipefail' in ci_lines


def test_quickstart_says_how_to_make_an_environment_for_its_install():
  """A system Python refuses `pip install` outside a virtual environment
  (PEP 668): the Quickstart's three commands stay the ones CI runs verbatim,
  and its text gives the command that makes and enters one first."""
  commands = _quickstart_commands()
  assert len(commands) == 3, commands
  assert commands[0].startswith('python3 -m pip install')
  section = (ROOT / 'README.md').read_text().split('## Quickstart', 1)[1]
  assert '`python3 -m venv .venv && source .venv/bin/activate`' in section


def test_quickstart_commands_use_files_that_exist():
  for command in _quickstart_commands():
    for path in re.findall(r'(\S+\.py)\b', command):
      assert (ROOT / path).exists(), path


def test_readme_is_short():
  """The README is the front page (what, why, install, three commands, one
  example, the configs, links); everything else lives in docs/. Its code
  blocks run in tests/test_docs.py."""
  lines = (ROOT / 'README.md').read_text().splitlines()
  assert len(lines) <= 200, len(lines)


def test_the_formatter_check_refuses_code_not_in_the_project_style(tmp_path):
  # 4-space indentation: pyink under pyproject.toml (2 spaces, 80 columns)
  # wants to reformat it, so `.ci/run` fails on such a file.
  path = tmp_path / 'misformatted.py'
  path.write_text('def f():\n    return 1\n')
  check = [sys.executable, '-m', 'pyink', '--check', '--config']
  config = str(ROOT / 'pyproject.toml')
  bad = subprocess.run([*check, config, str(path)], capture_output=True)
  assert bad.returncode == 1, bad.stderr
  path.write_text('def f():\n  return 1\n')
  good = subprocess.run([*check, config, str(path)], capture_output=True)
  assert good.returncode == 0, good.stderr
