"""Named registry of embedding-table initializers, each with its source.

Every entry builds a standard JAX initializer, a callable
`(key, shape, dtype=jnp.float32) -> Array`, usable anywhere a Flax
`embedding_init` / `kernel_init` is expected:

  >>> from flax_posemb import initializers
  >>> init = initializers.get('bert')                  # TF truncated normal(0.02)
  >>> init = initializers.get('normal', std=0.05)      # parametric
  >>> initializers.NAMES
  ('bert', 'flax_default', 'gpt2', 'gpt2_openai', 'normal', 'same_as_token', ...)

The returned objects are `Initializer` instances: callables that also carry their
`name`, their `overrides` and `expected_std(features)` (the realized standard
deviation of one draw, used to scale the `sinusoidal` init to the token table).

`same_as_token` and the default scale of `sinusoidal` depend on the token
embedding's initializer, so a model must resolve them with
`resolve(name, token_init=...)`; `get('same_as_token')` without `token_init`
raises. Sources are listed in `shared/REFERENCES.md`.

A table that was not drawn here (a GPT-2 `wpe`, a BERT table) is `from_array(table)`,
or through `resolve` the name `'file:PATH[:KEY]'` (`.npy`, `.npz`, `.safetensors`; read
by `flax_posemb.tables.load_table`), with a rule for a different number of rows
(`RESIZE_RULES`).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flax_posemb import tables

Array = jax.Array
InitFn = Callable[..., Array]

# TF's truncated normal (cut at +-2 std, not rescaled) keeps this fraction of the
# variance: Var[Z | |Z| < 2] for a standard normal Z.
_TRUNC2_STD_RATIO = math.sqrt(
    1.0 - 4.0 * math.exp(-2.0) / math.sqrt(2.0 * math.pi) / math.erf(2.0 / math.sqrt(2.0)))


@dataclasses.dataclass(frozen=True)
class Initializer:
  """A named JAX initializer `(key, shape, dtype) -> Array`.

  Attributes:
    name: Registry name that built it.
    fn: The underlying initializer.
    std_fn: `features -> float`, the realized std of one draw for a table of
      `features` columns (analytic, not sampled).
    overrides: The keyword overrides it was built with.
  """
  name: str
  fn: InitFn = dataclasses.field(repr=False)
  std_fn: Callable[[int], float] = dataclasses.field(repr=False)
  overrides: tuple[tuple[str, Any], ...] = ()

  def __call__(self, key: Array, shape, dtype=jnp.float32) -> Array:
    """Draws an array of `shape` (e.g. `[rows, features]`) and `dtype`."""
    return self.fn(key, tuple(shape), dtype)

  def expected_std(self, features: int) -> float:
    """Realized standard deviation of the entries for a `[*, features]` table."""
    return float(self.std_fn(int(features)))


def _check_std(name: str, std: Any) -> float:
  if std is None:
    raise ValueError(
        f"Initializer '{name}' needs a std: call initializers.get('{name}', std=0.02) "
        f"(in a config: set model.position_init_std / model.token_init_std >= 0).")
  std = float(std)
  if not math.isfinite(std) or std < 0:
    raise ValueError(f"Initializer '{name}': std must be a finite number >= 0, got {std}.")
  return std


def _normal(name: str, std: float) -> Initializer:
  def init(key, shape, dtype=jnp.float32):
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
  return Initializer(name, init, lambda f: std, (('std', std),))


def _tf_truncated_normal(name: str, std: float) -> Initializer:
  def init(key, shape, dtype=jnp.float32):
    z = jax.random.truncated_normal(key, -2.0, 2.0, shape, jnp.float32)
    return (std * z).astype(dtype)
  return Initializer(name, init, lambda f: std * _TRUNC2_STD_RATIO, (('std', std),))


def _uniform(name: str, bound_fn: Callable[[int], float], overrides=()) -> Initializer:
  def init(key, shape, dtype=jnp.float32):
    bound = bound_fn(shape[-1])
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound).astype(dtype)
  return Initializer(name, init, lambda f: bound_fn(f) / math.sqrt(3.0), overrides)


def sinusoid_table(num_positions: int, features: int,
                   max_wavelength: float = 10_000.0) -> np.ndarray:
  """Vaswani et al. (2017) sinusoid, interleaved sin/cos, RMS ~ 1/sqrt(2).

  Args:
    num_positions: Rows (position ids 0..num_positions-1).
    features: Columns.
    max_wavelength: Base of the geometric wavelength progression.

  Returns:
    float64 array `[num_positions, features]`; column `2i` is
    `sin(p / max_wavelength**(2i/features))`, column `2i+1` the matching cos.
  """
  return sinusoid_at(np.arange(num_positions), features, max_wavelength)


def sinusoid_at(positions, features: int, max_wavelength: float = 10_000.0):
  """Sinusoid rows for explicit positions (NumPy or JAX arrays).

  Args:
    positions: Integer or float array `[...]`.
    features: Columns of the encoding.
    max_wavelength: Base of the geometric wavelength progression.

  Returns:
    Array `[..., features]` (float64 for NumPy input, float32 for JAX input).
  """
  xp = jnp if isinstance(positions, jax.Array) else np
  dt = jnp.float32 if xp is jnp else np.float64
  i = xp.arange(features) // 2
  inv_freq = 1.0 / (max_wavelength ** (2.0 * i / features))
  angle = xp.asarray(positions, dt)[..., None] * inv_freq.astype(dt)
  return xp.where(xp.arange(features) % 2 == 0, xp.sin(angle), xp.cos(angle))


def _sinusoidal(name: str, std: float, max_wavelength: float = 10_000.0) -> Initializer:
  def init(key, shape, dtype=jnp.float32):
    del key  # Deterministic.
    if len(shape) != 2:
      raise ValueError(f"'{name}' initializes a [num_positions, features] table, got {shape}.")
    table = sinusoid_table(shape[0], shape[1], max_wavelength)
    rms = float(np.sqrt(np.mean(table**2))) or 1.0
    return jnp.asarray(table * (std / rms), dtype)
  return Initializer(name, init, lambda f: std,
                     (('std', std), ('max_wavelength', max_wavelength)))


# ---- Registry -------------------------------------------------------------------
# Each builder takes only keyword overrides; its docstring names the source.

def gpt2(std: float = 0.02) -> Initializer:
  """Normal(0, 0.02): nanoGPT (`karpathy/nanoGPT` model.py) and Hugging Face GPT-2, every embedding."""
  return _normal('gpt2', _check_std('gpt2', std))


def gpt2_openai(std: float = 0.01) -> Initializer:
  """Normal(0, 0.01): OpenAI's GPT-2 code (`openai/gpt-2` src/model.py) for `wpe`; Levanter uses it too."""
  return _normal('gpt2_openai', _check_std('gpt2_openai', std))


def bert(std: float = 0.02) -> Initializer:
  """BERT (`google-research/bert` modeling.py): TF truncated normal, `initializer_range` 0.02.

  Cut at 2 std and NOT rescaled (TensorFlow semantics), so the realized std is
  about 0.88 * std (0.0176 for 0.02). `jax.nn.initializers.truncated_normal`
  rescales and would not reproduce BERT.
  """
  return _tf_truncated_normal('bert', _check_std('bert', std))


def normal(std: float | None = None) -> Initializer:
  """Parametric Normal(0, std) (e.g. MaxText's trainable position embedding: std 1.0)."""
  return _normal('normal', _check_std('normal', std))


def truncated_normal(std: float | None = None) -> Initializer:
  """Parametric TF-style truncated normal: std parameter `std`, cut at 2 std, not rescaled (as `bert`)."""
  return _tf_truncated_normal('truncated_normal', _check_std('truncated_normal', std))


def flax_default() -> Initializer:
  """Flax `nn.Embed` default: variance scaling 1.0, fan-in, normal (std = 1/sqrt(features))."""
  base = jax.nn.initializers.variance_scaling(1.0, 'fan_in', 'normal', out_axis=0)  # As flax.
  return Initializer('flax_default', base, lambda f: 1.0 / math.sqrt(f))


def word2vec() -> Initializer:
  """Word2Vec's input vectors (original C code): uniform(-0.5/features, 0.5/features)."""
  return _uniform('word2vec', lambda f: 0.5 / f)


def small_uniform(bound: float = 1e-4) -> Initializer:
  """"SmallInit" (BlinkDL, RWKV): uniform(-1e-4, 1e-4), meant to be followed by a LayerNorm."""
  bound = float(bound)
  return _uniform('small_uniform', lambda f: bound, (('bound', bound),))


def zeros() -> Initializer:
  """All zeros (an untrained table: rows move only by their own gradient)."""
  return Initializer('zeros', jax.nn.initializers.zeros, lambda f: 0.0)


def sinusoidal(std: float | None = None, max_wavelength: float = 10_000.0) -> Initializer:
  """Learnable table initialized with the Vaswani et al. (2017) sinusoid, scaled to RMS `std`.

  The raw sinusoid has RMS ~0.71, which dwarfs a 0.02 token table, so the table
  is rescaled to RMS `std`; through `resolve` the default `std` is the token
  embedding's realized std.
  """
  return _sinusoidal('sinusoidal', _check_std('sinusoidal', std), float(max_wavelength))


def same_as_token(token_init: Initializer | None = None) -> Initializer:
  """Whatever initializer the model's token embedding uses (GPT-2/nanoGPT/BERT all share one init)."""
  if token_init is None:
    raise ValueError(
        "'same_as_token' depends on the token embedding's initializer: use "
        "initializers.resolve('same_as_token', token_init=...) or let TransformerLM resolve it.")
  if not callable(token_init):
    raise TypeError(f"same_as_token: token_init must be an initializer, got {token_init!r}.")
  return token_init


_BUILDERS: dict[str, Callable[..., Initializer]] = {
    'gpt2': gpt2,
    'gpt2_openai': gpt2_openai,
    'bert': bert,
    'normal': normal,
    'truncated_normal': truncated_normal,
    'flax_default': flax_default,
    'word2vec': word2vec,
    'small_uniform': small_uniform,
    'zeros': zeros,
    'sinusoidal': sinusoidal,
    'same_as_token': same_as_token,
}

NAMES: tuple[str, ...] = tuple(sorted(_BUILDERS))
# Names whose `std` can be overridden (model.position_init_std / token_init_std).
STD_NAMES: tuple[str, ...] = ('bert', 'gpt2', 'gpt2_openai', 'normal', 'sinusoidal',
                              'truncated_normal')


def _builder(name: str) -> Callable[..., Initializer]:
  if name not in _BUILDERS:
    raise ValueError(f"Unknown initializer {name!r}; valid names: {', '.join(NAMES)} "
                     f"(or a table file, 'file:PATH.npy|.npz[:KEY]|.safetensors:KEY').")
  return _BUILDERS[name]


def get(name: str, **overrides: Any) -> Initializer:
  """Builds the initializer registered as `name`.

  Args:
    name: One of `NAMES`.
    **overrides: Keyword arguments of that entry (e.g. `std=0.01` for the
      normal family and `sinusoidal`, `bound=` for `small_uniform`,
      `token_init=` for `same_as_token`).

  Returns:
    An `Initializer`, callable as `(key, shape, dtype) -> Array[shape]`.

  Raises:
    ValueError: unknown name, unknown override, or a missing required std.
  """
  builder = _builder(name)
  try:
    inspect.signature(builder).bind(**overrides)
  except TypeError:
    accepted = ', '.join(inspect.signature(builder).parameters) or 'none'
    raise ValueError(
        f"Initializer {name!r} does not accept overrides {sorted(overrides)}; "
        f"accepted: {accepted}.") from None
  return builder(**overrides)


def resolve(name: str, *, token_init: Initializer, std: float | None = None,
            resize: str = 'error', shape: tuple[int, ...] | None = None) -> Initializer:
  """Resolves a position-table initializer name against the token initializer.

  `same_as_token` becomes `token_init` itself; `sinusoidal` without `std` is scaled
  to `token_init`'s realized std; `file:PATH[:KEY]` is `from_array` of that file's
  table (`tables.load_table`); every other name is `get(name, std=std)` (or
  `get(name)` when `std` is None).

  Args:
    name: One of `NAMES`, or `'file:PATH.npy'`, `'file:PATH.npz[:KEY]'`,
      `'file:PATH.safetensors[:KEY]'`.
    token_init: The token embedding's initializer (an `Initializer`).
    std: Optional std override (`None` = the entry's default).
    resize: Row rule for a file table, one of `RESIZE_RULES` (see `from_array`).
    shape: The `[num_positions, features]` shape the initializer will be called
      with, if known: a file table is checked against it now, so that a mismatch
      fails when the config is built rather than at model init.

  Returns:
    An `Initializer` for a `[num_positions, features]` table.

  Raises:
    ValueError: unknown name, a std given for an entry that takes none, an unknown
      resize rule, or a file table that cannot be read or does not fit `shape`.
  """
  _check_resize(resize)
  if not tables.is_file_spec(name):
    _builder(name)
  if std is not None and name not in STD_NAMES:
    raise ValueError(
        f"Initializer {name!r} takes no std (got std={std}); std applies to "
        f"{', '.join(STD_NAMES)}. Set the std override to -1 (default).")
  if tables.is_file_spec(name):
    table = tables.load_table(name)
    if shape is not None:
      _check_fit(table.shape, tuple(shape), resize)
    return from_array(table, resize=resize, name=name)
  if name == 'same_as_token':
    return same_as_token(token_init)
  if name == 'sinusoidal' and std is None:
    if not isinstance(token_init, Initializer):
      raise ValueError("'sinusoidal' needs std= when token_init is not a registry Initializer.")
    return _LazySinusoidal(token_init)
  return get(name, **({} if std is None else {'std': std}))


# ---- Tables from elsewhere ---------------------------------------------------------

# How a table with a different number of rows than requested is fitted (never the width):
#   error:       rows must match exactly.
#   truncate:    keep the first rows; only when the table has at least as many rows.
#   interpolate: resample rows linearly, first and last rows kept (as ViT/DeiT resize their
#                position tables); new row i is old position i * (R - 1) / (rows - 1), so
#                the positional scale is stretched or compressed, not extended.
RESIZE_RULES: tuple[str, ...] = ('error', 'truncate', 'interpolate')


def _check_resize(resize: str) -> None:
  if resize not in RESIZE_RULES:
    raise ValueError(f"Unknown table resize rule {resize!r}; valid: {', '.join(RESIZE_RULES)} "
                     "(model.position_init_resize).")


def _check_fit(have: tuple[int, ...], want: tuple[int, ...], resize: str) -> None:
  """Raises ValueError unless a `have` table can fill `want` under `resize`."""
  if len(want) != 2:
    raise ValueError(f"A table initializer fills a [rows, features] shape, got {want}.")
  (rows, width), (want_rows, want_width) = have, want
  if width != want_width:
    raise ValueError(
        f"Table shape {have} does not fit the requested shape {want}: the table's width is "
        f"{width} features, the model's is {want_width} (model.emb_dim). No resize rule "
        f"changes the width: set model.emb_dim={width}, or use a table with {want_width} "
        f"columns.")
  if rows == want_rows or resize == 'interpolate':
    return
  if resize == 'error':
    raise ValueError(
        f"Table shape {have} does not fit the requested shape {want}: the table has {rows} "
        f"rows, the model asks for {want_rows} (model.max_len). Fix: set "
        f"model.max_len={rows}, or pick a row rule (model.position_init_resize): "
        + (f"'truncate' keeps the first {want_rows} rows, " if rows > want_rows else '')
        + f"'interpolate' resamples the {rows} rows linearly to {want_rows}.")
  if rows < want_rows:  # truncate
    raise ValueError(
        f"Table shape {have} does not fit the requested shape {want}: resize 'truncate' only "
        f"drops rows, and the table has {rows} rows, fewer than the {want_rows} asked for. "
        f"Fix: set model.max_len<={rows}, or use resize 'interpolate'.")


def fit_rows(table: np.ndarray, rows: int, resize: str = 'error') -> np.ndarray:
  """Fits `table` `[R, D]` to `[rows, D]` under a row rule (see `RESIZE_RULES`).

  Args:
    table: `[R, D]` table.
    rows: Rows wanted.
    resize: `'error'`, `'truncate'` or `'interpolate'`.

  Returns:
    `[rows, D]`: `table` itself or its first rows (same dtype), or for `'interpolate'`
    with `R != rows` a float64 linear resampling.

  Raises:
    ValueError: the rule does not allow going from `R` to `rows` rows.
  """
  _check_resize(resize)
  _check_fit(table.shape, (rows, table.shape[1]), resize)
  have = table.shape[0]
  if have == rows:
    return table
  if resize == 'truncate':
    return table[:rows]
  x = np.arange(rows) * ((have - 1) / (rows - 1)) if rows > 1 else np.zeros(1)
  lo = np.minimum(np.floor(x).astype(np.int64), have - 1)
  hi = np.minimum(lo + 1, have - 1)
  w = (x - lo)[:, None]
  t = np.asarray(table, np.float64)
  return (1.0 - w) * t[lo] + w * t[hi]


def from_array(array, *, resize: str = 'error', name: str = 'from_array') -> Initializer:
  """An initializer that returns a given table (e.g. a pretrained GPT-2 `wpe`).

  Args:
    array: `[R, D]` table (NumPy or JAX, any float dtype); copied, so later changes to
      `array` do not reach the initializer.
    resize: What to do when called with `R' != R` rows (`RESIZE_RULES`): `'error'`
      (default), `'truncate'` (first `R'` rows, needs `R' <= R`) or `'interpolate'`
      (linear resampling of the rows, see `fit_rows`). A different width `D` is
      always an error.
    name: The `Initializer`'s name (`resolve` passes the `file:` spec).

  Returns:
    An `Initializer` `(key, shape, dtype) -> Array[shape]` (the key is ignored) whose
    `expected_std` is the std of the table's entries.

  Raises:
    ValueError: `array` is not 2-D or `resize` is unknown (at once); at call time, a
      `shape` that the table cannot fill, naming both shapes and the fix.
  """
  _check_resize(resize)
  table = np.asarray(array)
  if table.ndim != 2:
    raise ValueError(f"from_array needs a 2-D [rows, features] table, got shape {table.shape}.")
  if table.flags.writeable:
    table = table.copy()
    table.flags.writeable = False
  std = float(np.std(np.asarray(table, np.float64)))

  def init(key, shape, dtype=jnp.float32):
    del key  # Deterministic.
    _check_fit(table.shape, tuple(shape), resize)
    return jnp.asarray(fit_rows(table, shape[0], resize), dtype)
  return Initializer(name, init, lambda f: std,
                     (('shape', table.shape), ('resize', resize)))


def _LazySinusoidal(token_init: Initializer) -> Initializer:  # pylint: disable=invalid-name
  """Sinusoidal init whose RMS is the token init's realized std at the table's width."""
  def init(key, shape, dtype=jnp.float32):
    std = token_init.expected_std(shape[-1])
    if std <= 0:
      raise ValueError(
          f"'sinusoidal' scales to the token init's std, but {token_init.name!r} has std 0; "
          "set model.position_init_std.")
    return sinusoidal(std)(key, shape, dtype)
  return Initializer('sinusoidal', init, token_init.std_fn,
                     (('std', f'same_as_token:{token_init.name}'),))
