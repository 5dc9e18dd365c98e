"""Named embedding-table initializers (`get`, `resolve`); sources in
docs/REFERENCES.md."""

from collections.abc import Callable
import dataclasses
import functools
import inspect
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flax_posemb import tables

Array = jax.Array
InitFn = Callable[..., Array]

# TF's truncated normal (cut at +-2 std, not rescaled) keeps this fraction of
# the std.
_TRUNC2_STD_RATIO = math.sqrt(
    1.0
    - 4.0
    * math.exp(-2.0)
    / math.sqrt(2.0 * math.pi)
    / math.erf(2.0 / math.sqrt(2.0))
)


@dataclasses.dataclass(frozen=True)
class Initializer:
  """A named JAX initializer `(key, shape, dtype) -> Array`.

  Build one with `get`, `resolve` or `from_array`; it can be passed wherever
  Flax takes an initializer (e.g. `embedding_init`).

  Args:
    name: the registry name (or the `file:` spec) it was built from.
    fn: the initializer, `(key, shape, dtype) -> Array`.
    std_fn: the realized standard deviation of the entries of a table of the
      given width, `features -> std`.
  """

  name: str
  fn: InitFn = dataclasses.field(repr=False)
  std_fn: Callable[[int], float] = dataclasses.field(repr=False)

  def __call__(self, key: Array, shape, dtype=jnp.float32) -> Array:
    """Draws a table.

    Args:
      key: a JAX PRNG key (ignored by the deterministic initializers).
      shape: the table's shape, `(rows, features)` (e.g. `(max_len, emb_dim)`).
      dtype: dtype of the table.

    Returns:
      The table, `shape` in `dtype`.

    Raises:
      ValueError: a `from_array` table that cannot fill `shape`.
    """
    return self.fn(key, tuple(shape), dtype)

  def expected_std(self, features: int) -> float:
    """The realized standard deviation of the entries of a table.

    Args:
      features: the table's width (some initializers scale with it).

    Returns:
      The std the drawn entries have (e.g. ~0.0176 for `bert`'s truncated
      0.02).
    """
    return float(self.std_fn(int(features)))


def _check_std(name: str, std: Any) -> float:
  if std is None or not math.isfinite(float(std)) or float(std) < 0:
    raise ValueError(
        f"Initializer '{name}' needs a std, a finite number >= 0 (got"
        f' {std}): pass std=0.02 (in a ModelConfig: position_init_std /'
        ' token_init_std >= 0).'
    )
  return float(std)


# Normal(0, std) entries: name -> (default std, TF truncation: cut at 2 std, not
# rescaled).
_NORMALS = {
    # nanoGPT (karpathy/nanoGPT model.py), Hugging Face GPT-2: all tables.
    'gpt2': (0.02, False),
    # OpenAI GPT-2 (openai/gpt-2 src/model.py) `wpe`; Levanter.
    'gpt2_openai': (0.01, False),
    # BERT (google-research/bert modeling.py): realized std ~0.0176.
    'bert': (0.02, True),
    # Parametric (e.g. MaxText's trainable position table: std 1.0).
    'normal': (None, False),
    'truncated_normal': (None, True),  # Parametric, truncated as `bert`.
}


def _normal(name: str, std: float | None = None) -> Initializer:
  default, truncated = _NORMALS[name]
  std = _check_std(name, default if std is None else std)

  def init(key, shape, dtype=jnp.float32):
    if truncated:
      z = jax.random.truncated_normal(key, -2.0, 2.0, shape, jnp.float32)
    else:
      z = jax.random.normal(key, shape, jnp.float32)
    return (std * z).astype(dtype)

  realized = std * _TRUNC2_STD_RATIO if truncated else std
  return Initializer(name, init, lambda f: realized)


# Uniform(-b, b) entries: name -> b of the table's width.
_UNIFORMS: dict[str, Callable[[int], float]] = {
    # Word2Vec's input vectors (original C code).
    'word2vec': lambda f: 0.5 / f,
    # "SmallInit" (BlinkDL, RWKV): followed by a LayerNorm.
    'small_uniform': lambda f: 1e-4,
}


def _uniform(name: str, bound_fn: Callable[[int], float]) -> Initializer:
  def init(key, shape, dtype=jnp.float32):
    bound = bound_fn(shape[-1])
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound).astype(
        dtype
    )

  return Initializer(name, init, lambda f: bound_fn(f) / math.sqrt(3.0))


def sinusoid_at(positions, features: int, max_wavelength: float = 10_000.0):
  """Vaswani sinusoid of unit amplitude at `positions`.

  Column `2i` is `sin(p / max_wavelength**(2i/features))`, column `2i+1` the
  cos.

  Args:
    positions: positions, `[...]`: a NumPy array (computed in float64) or a
      JAX array (computed in float32).
    features: width of the encoding.
    max_wavelength: the longest wavelength.

  Returns:
    The encoding, `[..., features]`, NumPy float64 or JAX float32 as
    `positions` is.
  """
  xp = jnp if isinstance(positions, jax.Array) else np
  dt = jnp.float32 if xp is jnp else np.float64
  i = xp.arange(features) // 2
  inv_freq = 1.0 / (max_wavelength ** (2.0 * i / features))
  angle = xp.asarray(positions, dt)[..., None] * inv_freq.astype(dt)
  return xp.where(xp.arange(features) % 2 == 0, xp.sin(angle), xp.cos(angle))


# The default of the embedding modules.
gpt2 = functools.partial(_normal, 'gpt2')


def flax_default() -> Initializer:
  """Flax `nn.Embed` default: variance scaling 1.0, fan-in, normal (std =
  1/sqrt(features))."""
  base = jax.nn.initializers.variance_scaling(
      1.0, 'fan_in', 'normal', out_axis=0
  )
  return Initializer('flax_default', base, lambda f: 1.0 / math.sqrt(f))


def zeros() -> Initializer:
  """All zeros (an untrained table: rows move only by their own gradient)."""
  return Initializer('zeros', jax.nn.initializers.zeros, lambda f: 0.0)


def sinusoidal(
    std: float | None = None, max_wavelength: float = 10_000.0
) -> Initializer:
  """Vaswani et al. (2017) sinusoid as the initial value of a learned table.

  Args:
    std: the table's root-mean-square (`resolve` passes the token table's
      std when the config gives none).
    max_wavelength: the longest wavelength.

  Returns:
    A deterministic initializer of `[rows, features]` tables.

  Raises:
    ValueError: `std` is None, negative or not finite.
  """
  std = _check_std('sinusoidal', std)

  def init(key, shape, dtype=jnp.float32):
    del key  # Deterministic.
    table = sinusoid_at(np.arange(shape[0]), shape[1], max_wavelength)
    rms = float(np.sqrt(np.mean(table**2))) or 1.0
    return jnp.asarray(table * (std / rms), dtype)

  return Initializer('sinusoidal', init, lambda f: std)


def same_as_token(token_init: Initializer | None = None) -> Initializer:
  """Whatever the model's token embedding uses (GPT-2, nanoGPT and BERT share
  one init).

  Args:
    token_init: the token table's initializer.

  Returns:
    `token_init` itself.

  Raises:
    ValueError: `token_init` is None (`get('same_as_token')` has none; use
      `resolve`).
  """
  if token_init is None:
    raise ValueError(
        "'same_as_token' depends on the token embedding's initializer: use "
        "initializers.resolve('same_as_token', token_init=...)."
    )
  return token_init


_BUILDERS: dict[str, Callable[..., Initializer]] = {
    **{n: functools.partial(_normal, n) for n in _NORMALS},
    **{
        n: functools.partial(_uniform, n, bound)
        for n, bound in _UNIFORMS.items()
    },
    **{f.__name__: f for f in (flax_default, zeros, sinusoidal, same_as_token)},
}
NAMES: tuple[str, ...] = tuple(sorted(_BUILDERS))
# Names whose `std` can be overridden (model.position_init_std /
# token_init_std).
STD_NAMES: tuple[str, ...] = tuple(
    n for n in NAMES if 'std' in inspect.signature(_BUILDERS[n]).parameters
)


def get(name: str, **overrides: Any) -> Initializer:
  """The initializer registered as `name`, built with keyword `overrides`.

  Args:
    name: one of `NAMES` (e.g. `'gpt2'`, `'bert'`, `'sinusoidal'`).
    **overrides: keyword arguments of the entry's builder (e.g. `std=0.01`
      for the names in `STD_NAMES`).

  Returns:
    The initializer.

  Raises:
    ValueError: an unknown `name` (the message lists `NAMES`), an override
      the entry does not accept, or an invalid `std`.
  """
  builder = _BUILDERS.get(name)
  if builder is None:
    raise ValueError(
        f"Unknown initializer {name!r}; valid names: {', '.join(NAMES)} (or a"
        " table file, 'file:PATH.npy|.npz[:KEY]|.safetensors[:KEY]')."
    )
  accepted = inspect.signature(builder).parameters
  if not set(overrides) <= set(accepted):
    raise ValueError(
        f'Initializer {name!r} does not accept overrides {sorted(overrides)};'
        f" accepted: {', '.join(accepted) or 'none'}."
    )
  return builder(**overrides)


def resolve(
    name: str,
    *,
    token_init: Initializer,
    std: float | None = None,
    resize: str = 'error',
) -> Initializer:
  """The initializer of a `[num_positions, features]` position table.

  Args:
    name: One of `NAMES`, or a table file `'file:PATH[:KEY]'`
      (`tables.load_table`).
    token_init: The token table's initializer: `same_as_token` is it, and
      `sinusoidal` without `std` is scaled to its realized std.
    std: Optional std override (None = the entry's default).
    resize: Row rule of a file table (`from_array`).

  Returns:
    The initializer (a file table's is deterministic).

  Raises:
    ValueError: an unknown name, a `std` the entry refuses, or a file table
      with an unknown `resize`; `tables.TableError` (a ValueError) for a file
      that cannot be read.
  """
  if tables.is_file_spec(name):
    return from_array(tables.load_table(name), resize=resize, name=name)
  if name == 'same_as_token':
    return token_init
  if name == 'sinusoidal' and std is None:

    def init(key, shape, dtype=jnp.float32):
      return sinusoidal(token_init.expected_std(shape[-1]))(key, shape, dtype)

    return Initializer('sinusoidal', init, token_init.std_fn)
  return get(name, **({} if std is None else {'std': std}))


# Row rules (never the width): error (must match), truncate (first rows),
# interpolate (ViT/DeiT).
RESIZE_RULES: tuple[str, ...] = ('error', 'truncate', 'interpolate')


def check_resize(resize: str) -> None:
  """Checks a table row rule.

  Args:
    resize: the rule (`model.position_init_resize`).

  Raises:
    ValueError: `resize` is not one of `RESIZE_RULES`.
  """
  if resize not in RESIZE_RULES:
    raise ValueError(
        f'Unknown table resize rule {resize!r}; valid:'
        f" {', '.join(RESIZE_RULES)} (resize=; in a ModelConfig"
        ' position_init_resize).'
    )


def fit_problem(
    have: tuple[int, int], want: tuple[int, int], resize: str
) -> str | None:
  """Why a table of one shape cannot fill another under a row rule.

  Args:
    have: the table's shape, `(rows, features)`.
    want: the shape asked for, `(rows, features)`.
    resize: one of `RESIZE_RULES`; no rule changes the width.

  Returns:
    A message naming the mismatch and the fix, or None if the table fits.
  """
  rows, width = have
  want_rows, want_width = want
  head = f'Table shape {have} does not fit the requested shape {want}: '
  if width != want_width:
    return head + (
        f"the table's width is {width} features, the embedding's"
        f' {want_width}; no resize rule changes it: use {want_width} columns'
        f' or features={width} (ModelConfig.emb_dim={width}).'
    )
  if rows == want_rows or resize == 'interpolate':
    return None
  if resize == 'truncate':
    if rows > want_rows:
      return None
    return head + (
        f"resize 'truncate' only drops rows, and the table has {rows} <"
        f' {want_rows} rows: use num_positions<={rows}'
        f" (ModelConfig.max_len<={rows}) or resize 'interpolate'."
    )
  rules = ''
  if rows > want_rows:
    rules = f"'truncate' keeps the first {want_rows} rows, "
  rules += f"'interpolate' resamples the {rows} rows linearly to {want_rows}."
  return head + (
      f'the table has {rows} rows, the embedding {want_rows}'
      f' (num_positions): use num_positions={rows}'
      f' (ModelConfig.max_len={rows}) or a row rule (resize=;'
      ' ModelConfig.position_init_resize): ' + rules
  )


def fit_rows(table: np.ndarray, rows: int, resize: str = 'error') -> np.ndarray:
  """Fits a table's rows to `rows` under a rule that allows it.

  Args:
    table: the table, `[R, D]`.
    rows: rows wanted.
    resize: `'truncate'` (the first `rows`, needs `R >= rows`) or
      `'interpolate'` (linear resampling: new row `i` is old position
      `i * (R - 1) / (rows - 1)`); with `R == rows` any rule. Check first with
      `fit_problem`; this does not refuse.

  Returns:
    The table `[rows, D]`, `table` itself when `R == rows`, its first rows,
    or float64 interpolated rows.
  """
  have = table.shape[0]
  if have == rows:
    return table
  if resize == 'truncate':
    return table[:rows]
  x = np.linspace(0, have - 1, rows)
  lo = np.floor(x).astype(np.int64)
  hi = np.minimum(lo + 1, have - 1)
  w = (x - lo)[:, None]
  t = np.asarray(table, np.float64)
  return (1.0 - w) * t[lo] + w * t[hi]


def from_array(
    array, *, resize: str = 'error', name: str = 'from_array'
) -> Initializer:
  """An initializer returning a copy of a given table (e.g. GPT-2's `wpe`).

  Args:
    array: the table, `[R, D]` (anything `np.array` takes).
    resize: how its rows are fitted to the shape asked for (`RESIZE_RULES`).
    name: the initializer's name (e.g. the `file:` spec it came from).

  Returns:
    A deterministic initializer; called with a shape it cannot fill it raises
    ValueError (`fit_problem`'s message).

  Raises:
    ValueError: an unknown `resize`, or `array` is not 2-D.
  """
  check_resize(resize)
  table = np.array(array)
  if table.ndim != 2:
    raise ValueError(
        'from_array needs a 2-D [rows, features] table, got shape'
        f' {table.shape}.'
    )
  std = float(np.std(np.asarray(table, np.float64)))

  def init(key, shape, dtype=jnp.float32):
    del key  # Deterministic.
    problem = fit_problem(table.shape, tuple(shape), resize)
    if problem:
      raise ValueError(problem)
    return jnp.asarray(fit_rows(table, shape[0], resize), dtype)

  return Initializer(name, init, lambda f: std)


# Rules for the rows a checkpoint's table gains when model.max_len exceeds its
# rows (`extend_rows`; config init_from_new_rows).
EXTEND_RULES: tuple[str, ...] = ('copy_last', 'interpolate', 'init')


def extend_rows(
    table: np.ndarray,
    rows: int,
    rule: str,
    fresh: np.ndarray | None = None,
) -> np.ndarray:
  """`table` `[n, D]` as `[rows, D]`: its rows `0..min(n, rows) - 1` as they
  are (bit-identical), new rows `n..rows - 1` by `rule`.

  Args:
    table: the checkpoint's table `[n, D]`.
    rows: rows wanted (fewer than `n`: the first `rows`).
    rule: 'copy_last': the last `k = min(rows - n, n)` rows, repeated in order
      (new row `i` is row `n - k + (i - n) % k`; Longformer's copy init when
      `rows >= 2 n`). 'interpolate': what position interpolation gives them, the
      table resampled linearly to `rows` rows (`fit_rows`; new row `i` is old
      position `i (n - 1) / (rows - 1)`). 'init': the rows of `fresh`.
    fresh: `[rows, D]` drawn by a registry initializer (for 'init').

  Returns:
    The table, `[rows, D]` in `table`'s dtype.

  Raises:
    ValueError: an unknown `rule` (one of `EXTEND_RULES`), or `'init'` without
      `fresh` of shape `[rows, D]`.
  """
  n = table.shape[0]
  if rows <= n:
    return table[:rows]
  if rule not in EXTEND_RULES:
    raise ValueError(
        f'Unknown rule {rule!r} for new table rows; valid:'
        f' {", ".join(EXTEND_RULES)} (init_from_new_rows).'
    )
  if rule == 'copy_last':
    k = min(rows - n, n)
    new = table[n - k + np.arange(rows - n) % k]
  elif rule == 'interpolate':
    new = fit_rows(table, rows, 'interpolate')[n:]
  else:
    if fresh is None or fresh.shape != (rows, table.shape[1]):
      raise ValueError(
          f"Rule 'init' needs fresh rows of shape {(rows, table.shape[1])}."
      )
    new = fresh[n:]
  return np.concatenate([table, np.asarray(new, table.dtype)])
