"""Tests of flax_posemb.checkpointing: exact round trips, refusals and
recovery."""

import errno
import json
import logging
import os
import pathlib
import subprocess
import sys
import textwrap

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flax_posemb import checkpointing

LOGGER = 'flax_posemb.checkpointing'
REPO = pathlib.Path(__file__).resolve().parents[1]


def _params(max_len=8, dim=4):
  k1, k2 = jax.random.split(jax.random.key(0))
  return {
      'pos_embed': {'embedding': jax.random.normal(k1, (max_len, dim))},
      'token_embed': {'embedding': jax.random.normal(k2, (16, dim))},
      'ln': {'scale': jnp.ones((dim,)), 'bias': jnp.zeros((dim,))},
  }


def _trained_state(params):
  """AdamW state after one update, so moments and count are non-trivial."""
  tx = optax.adamw(1e-2, b2=0.95, weight_decay=0.1)
  opt_state = tx.init(params)
  grads = jax.tree.map(lambda p: jnp.cos(p) + 0.5, params)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


def _stats():
  return {
      # not float-exact
      'count': np.array([2**40 + 1, 2**53 + 3, 0, 7], np.int64),
      'loss_sum': np.array([1.25, 3.5, 0.0, 1e-30], np.float64),
      'steps': 12,
  }


def _data_iter():
  ds = grain.MapDataset.range(40).shuffle(seed=3).map(lambda x: x * 10).batch(4)
  return iter(ds)


def _save(ckpt, step, params, opt_state, it, **kw):
  return ckpt.save(
      step,
      params=params,
      opt_state=opt_state,
      data_iter=it,
      stats=kw.get('stats', _stats()),
      config=kw.get('config', {'seed': 0, 'step': step}),
      counters=kw.get('counters'),
  )


def _assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert np.asarray(x).dtype == np.asarray(y).dtype
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _abstract(tree):
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(
          x.shape, x.dtype, sharding=getattr(x, 'sharding', None)
      ),
      tree,
  )


@pytest.mark.smoke
def test_round_trip_is_exact_for_every_item(tmp_path):
  params, opt_state = _trained_state(_params())
  it = _data_iter()
  for _ in range(3):
    next(it)
  host_params = jax.device_get(params)
  host_opt_state = jax.device_get(opt_state)
  with checkpointing.Checkpointer(
      tmp_path / 'checkpoints', max_to_keep=3
  ) as ck:
    assert _save(
        ck,
        3,
        params,
        opt_state,
        it,
        config={'model': {'max_len': 8}, 'lr': 3e-3},
        counters={'loss_sum': 1.25, 'loss_steps': 3, 'tokens': 2**53 + 3},
    )
    # The async save must not read the device buffers after save() returns
    # (the train step donates them).
    for x in jax.tree.leaves((params, opt_state)):
      x.delete()
    ck.wait_until_finished()
  params, opt_state = host_params, host_opt_state
  expected_batches = [next(it) for _ in range(3)]

  fresh = _data_iter()
  with checkpointing.Checkpointer(
      tmp_path / 'checkpoints', max_to_keep=3
  ) as ck:
    assert ck.latest_step() == 3 and ck.all_steps() == [3]
    r = ck.restore(
        abstract_params=_abstract(params),
        abstract_opt_state=_abstract(opt_state),
        data_iter=fresh,
    )
  assert r['step'] == 3
  _assert_trees_equal(r['params'], params)
  _assert_trees_equal(r['opt_state'], opt_state)
  assert type(r['opt_state'][0]).__name__ == 'ScaleByAdamState'
  assert r['stats']['count'].dtype == np.int64
  np.testing.assert_array_equal(r['stats']['count'], _stats()['count'])
  np.testing.assert_array_equal(r['stats']['loss_sum'], _stats()['loss_sum'])
  assert int(r['stats']['steps']) == 12
  assert r['counters']['loss_sum'].item() == 1.25
  assert r['counters']['tokens'].item() == 2**53 + 3  # int64, exact
  assert r['config'] == {'model': {'max_len': 8}, 'lr': 3e-3}
  for want in expected_batches:  # the iterator continues exactly
    np.testing.assert_array_equal(next(fresh), want)
  layout = {p.name for p in (tmp_path / 'checkpoints' / '3').iterdir()}
  items = {'params', 'opt_state', 'data_iter', 'stats', 'counters', 'config'}
  assert items <= layout


def test_max_to_keep_always_keeps_step_zero(tmp_path):
  params, opt_state = _trained_state(_params())
  it = _data_iter()
  with checkpointing.Checkpointer(tmp_path, max_to_keep=2) as ck:
    for step in range(0, 60, 10):
      assert _save(ck, step, params, opt_state, it)
    ck.wait_until_finished()
    assert ck.all_steps() == [0, 40, 50]
  assert sorted(
      int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()
  ) == [0, 40, 50]
  with checkpointing.Checkpointer(tmp_path, max_to_keep=2) as ck:
    assert ck.all_steps() == [0, 40, 50]


def test_empty_stats_and_no_data_iter_round_trip(tmp_path):
  params, opt_state = _trained_state(_params())
  with checkpointing.Checkpointer(tmp_path, max_to_keep=2) as ck:
    assert ck.save(
        1,
        params=params,
        opt_state=opt_state,
        data_iter=None,
        stats=None,
        config={'a': 1},
    )
    ck.wait_until_finished()
    r = ck.restore(
        abstract_params=_abstract(params),
        abstract_opt_state=_abstract(opt_state),
        data_iter=None,
    )
    assert r['stats'] == {} and r['config'] == {'a': 1}
    with pytest.raises(ValueError, match='without a data iterator'):
      ck.restore(
          abstract_params=_abstract(params),
          abstract_opt_state=_abstract(opt_state),
          data_iter=_data_iter(),
      )


def test_existing_step_is_not_overwritten(tmp_path, caplog):
  params, opt_state = _trained_state(_params())
  with checkpointing.Checkpointer(tmp_path, max_to_keep=2) as ck:
    assert _save(ck, 7, params, opt_state, None, config={'v': 1})
    ck.wait_until_finished()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
      assert not _save(ck, 7, params, opt_state, None, config={'v': 2})
    ck.wait_until_finished()
  _, config, _ = checkpointing.restore_params(tmp_path)
  assert config == {'v': 1}
  assert 'not overwritten' in caplog.text


def _truncate_params(step_dir):
  for f in (step_dir / 'params').rglob('*'):
    if f.is_file() and f.name != 'commit_success.txt':
      f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _garble_metadata(step_dir):
  (step_dir / 'params' / '_METADATA').write_text('{"tree_metadata": gar')


def _delete_stats(step_dir):
  for f in sorted((step_dir / 'stats').rglob('*'), reverse=True):
    f.rmdir() if f.is_dir() else f.unlink()


def _delete_iter_state(step_dir):
  (step_dir / 'data_iter' / 'process_0-of-1.json').unlink()


@pytest.mark.parametrize(
    'damage',
    [_truncate_params, _garble_metadata, _delete_stats, _delete_iter_state],
)
def test_corrupted_latest_falls_back_with_warning_and_is_kept(
    tmp_path, caplog, damage
):
  params, opt_state = _trained_state(_params())
  it = _data_iter()
  with checkpointing.Checkpointer(tmp_path, max_to_keep=3) as ck:
    _save(ck, 10, params, opt_state, it)
    next(it)
    later = jax.tree.map(lambda x: x + 1, params)
    _save(ck, 20, later, opt_state, it)
  damage(tmp_path / '20')

  with checkpointing.Checkpointer(tmp_path, max_to_keep=3) as ck:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
      r = ck.restore(
          abstract_params=_abstract(params),
          abstract_opt_state=_abstract(opt_state),
          data_iter=_data_iter(),
          fallback=True,
      )
    assert r['step'] == 10
    _assert_trees_equal(r['params'], params)
    assert str(tmp_path / '20') in caplog.text
    assert (tmp_path / '20').is_dir()  # never deleted
    with pytest.raises(
        checkpointing.CheckpointDamagedError, match=str(tmp_path / '20')
    ):
      ck.restore(
          20,
          abstract_params=_abstract(params),
          abstract_opt_state=_abstract(opt_state),
          data_iter=_data_iter(),
      )


def test_corrupted_latest_params_falls_back_in_params_only_restore(
    tmp_path, caplog
):
  params, opt_state = _trained_state(_params())
  with checkpointing.Checkpointer(
      tmp_path / 'checkpoints', max_to_keep=3
  ) as ck:
    _save(ck, 1, params, opt_state, None)
    _save(ck, 2, params, opt_state, None)
  _truncate_params(tmp_path / 'checkpoints' / '2')
  with caplog.at_level(logging.WARNING, logger=LOGGER):
    _, _, info = checkpointing.restore_params(tmp_path)
  assert info.step == 1
  assert str(tmp_path / 'checkpoints' / '2') in caplog.text


def test_checkpoint_of_another_model_shape_is_a_clear_error(tmp_path):
  params, opt_state = _trained_state(_params(max_len=8))
  with checkpointing.Checkpointer(tmp_path, max_to_keep=3) as ck:
    _save(ck, 5, params, opt_state, None)
  bigger, bigger_opt = _trained_state(_params(max_len=16))
  with checkpointing.Checkpointer(tmp_path, max_to_keep=3) as ck:
    with pytest.raises(checkpointing.CheckpointMismatchError) as e:
      ck.restore(
          abstract_params=_abstract(bigger),
          abstract_opt_state=_abstract(bigger_opt),
          data_iter=None,
      )
  msg = str(e.value)
  assert 'pos_embed/embedding' in msg and '(8, 4)' in msg and '(16, 4)' in msg
  assert 'fresh --workdir' in msg
  assert isinstance(e.value, ValueError)
  extra = dict(params, head={'kernel': jnp.zeros((4, 16))})
  with checkpointing.Checkpointer(tmp_path, max_to_keep=3) as ck:
    with pytest.raises(
        checkpointing.CheckpointMismatchError, match='head/kernel'
    ):
      ck.restore(
          abstract_params=_abstract(extra),
          abstract_opt_state=_abstract(opt_state),
          data_iter=None,
      )
  assert (tmp_path / '5').is_dir()


def test_params_only_restore_reads_shapes_from_metadata(tmp_path):
  params, opt_state = _trained_state(_params())
  with checkpointing.Checkpointer(
      tmp_path / 'checkpoints', max_to_keep=3
  ) as ck:
    _save(ck, 0, _params(), opt_state, None, config={'init': True})
    _save(
        ck, 4, params, opt_state, _data_iter(), config={'model': {'emb_dim': 4}}
    )
  for where in (tmp_path, tmp_path / 'checkpoints'):
    restored, config, info = checkpointing.restore_params(where)
    assert info.step == 4 and config == {'model': {'emb_dim': 4}}
    _assert_trees_equal(restored, params)
  restored, config, info = checkpointing.restore_params(tmp_path, step=0)
  assert info.step == 0 and config == {'init': True}
  _assert_trees_equal(restored, _params())
  dev = jax.devices()[0]
  restored, _, _ = checkpointing.restore_params(
      tmp_path, sharding=jax.sharding.SingleDeviceSharding(dev)
  )
  assert restored['pos_embed']['embedding'].devices() == {dev}


def test_missing_checkpoint_errors_name_the_directory(tmp_path):
  with pytest.raises(FileNotFoundError, match='run train.py first') as e:
    checkpointing.restore_params(tmp_path / 'nothing')
  assert str(tmp_path / 'nothing') in str(e.value)
  (tmp_path / 'checkpoints').mkdir()
  with pytest.raises(FileNotFoundError, match='no checkpoint under'):
    checkpointing.restore_params(tmp_path)
  params, opt_state = _trained_state(_params())
  with checkpointing.Checkpointer(
      tmp_path / 'checkpoints', max_to_keep=1
  ) as ck:
    with pytest.raises(FileNotFoundError, match='run train.py first'):
      ck.restore(
          abstract_params=params, abstract_opt_state=opt_state, data_iter=None
      )
    _save(ck, 3, params, opt_state, None)
    with pytest.raises(FileNotFoundError, match=r'available steps: \[3\]'):
      ck.restore(
          9,
          abstract_params=params,
          abstract_opt_state=opt_state,
          data_iter=None,
      )


def test_a_config_that_is_not_json_is_a_clear_error(tmp_path):
  params, opt_state = _trained_state(_params())
  with checkpointing.Checkpointer(tmp_path, max_to_keep=1) as ck:
    with pytest.raises(TypeError, match='JSON'):
      _save(ck, 1, params, opt_state, None, config={'f': object()})


_MULTIDEVICE = textwrap.dedent("""
    import os, sys
    os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from flax_posemb import checkpointing
    assert jax.device_count() == 8, jax.devices()
    src = sys.argv[1]
    mesh = Mesh(np.array(jax.devices()), ('data',))
    want = dict(np.load(os.path.join(src, 'want.npz')))

    # Full restore onto the mesh: position table sharded by rows.
    def sharding_for(path, x):
      spec = P('data') if x.ndim == 2 and x.shape[0] % 8 == 0 else P()
      return NamedSharding(mesh, spec)
    params = {'pos_embed': {'embedding': jnp.zeros((8, 4))},
              'token_embed': {'embedding': jnp.zeros((16, 4))},
              'ln': {'scale': jnp.zeros((4,)), 'bias': jnp.zeros((4,))}}
    opt_state = optax.adamw(1e-2).init(params)
    abstract = lambda t: jax.tree_util.tree_map_with_path(
        lambda p, x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                          sharding=sharding_for(p, x)), t)
    with checkpointing.Checkpointer(os.path.join(src, 'checkpoints'),
                                    max_to_keep=3) as ck:
      r = ck.restore(abstract_params=abstract(params),
                     abstract_opt_state=abstract(opt_state), data_iter=None)
    table = r['params']['pos_embed']['embedding']
    assert table.sharding.spec == P('data'), table.sharding
    assert len(table.addressable_shards) == 8
    np.testing.assert_array_equal(np.asarray(table), want['table'])
    mu = r['opt_state'][0].mu['pos_embed']['embedding']
    assert mu.sharding.spec == P('data')

    # Params-only restore, replicated over the mesh.
    rep = NamedSharding(mesh, P())
    p2, cfg, info = checkpointing.restore_params(src, sharding=rep)
    assert info.step == 1 and cfg == {'ok': 1}
    t2 = p2['pos_embed']['embedding']
    assert t2.sharding == rep
    np.testing.assert_array_equal(np.asarray(t2), want['table'])

    # Save sharded arrays from 8 devices for the 1-device parent to read.
    with checkpointing.Checkpointer(os.path.join(src, 'checkpoints'),
                                    max_to_keep=3) as ck:
      assert ck.save(2, params=jax.tree.map(lambda x: x * 2, r['params']),
                     opt_state=r['opt_state'], data_iter=None,
                     stats={'n': 1}, config={'ok': 2})
    print('MULTIDEVICE_OK')
""")


def test_restore_onto_8_forced_cpu_devices_and_back(tmp_path):
  params, opt_state = _trained_state(_params())
  with checkpointing.Checkpointer(
      tmp_path / 'checkpoints', max_to_keep=3
  ) as ck:
    _save(ck, 1, params, opt_state, None, config={'ok': 1})
  np.savez(
      tmp_path / 'want.npz', table=np.asarray(params['pos_embed']['embedding'])
  )
  script = tmp_path / 'multidevice.py'
  script.write_text(_MULTIDEVICE)
  env = dict(
      os.environ,
      JAX_PLATFORMS='cpu',
      PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get('PYTHONPATH', '')]),
  )
  env.pop('XLA_FLAGS', None)
  proc = subprocess.run(
      [sys.executable, str(script), str(tmp_path)],
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert 'MULTIDEVICE_OK' in proc.stdout, proc.stderr[-4000:]
  restored, config, info = checkpointing.restore_params(tmp_path)
  assert info.step == 2 and config == {'ok': 2}
  np.testing.assert_array_equal(
      np.asarray(restored['pos_embed']['embedding']),
      2 * np.asarray(params['pos_embed']['embedding']),
  )


def test_relative_workdir_saves_and_restores(tmp_path, monkeypatch):
  # The README runs `train.py --workdir runs/tiny`; Orbax itself rejects
  # relative paths.
  monkeypatch.chdir(tmp_path)
  params, opt_state = _trained_state(_params())
  with checkpointing.Checkpointer(
      checkpointing.checkpoint_dir('runs/rel'), max_to_keep=2
  ) as ckpt:
    assert _save(ckpt, 3, params, opt_state, _data_iter())
    ckpt.wait_until_finished()
  restored, _, info = checkpointing.restore_params('runs/rel')
  assert info.step == 3
  _assert_trees_equal(jax.device_get(params), restored)


# --- Integrity: digests, classification, steps deleted under a
# reader ---------


def _flip_params_byte(step_dir):
  """Flips one bit in the middle of the largest params data file:
  Orbax/TensorStore read such a flip back silently (zstd frames carry no
  checksum) -- 4 values change."""
  f = max(
      (x for x in (step_dir / 'params').rglob('*') if x.is_file()),
      key=lambda x: x.stat().st_size,
  )
  b = bytearray(f.read_bytes())
  b[len(b) // 2] ^= 0x10
  f.write_bytes(bytes(b))


def test_flipped_params_byte_names_the_damaged_step_and_falls_back(
    tmp_path, caplog
):
  params, opt_state = _trained_state(_params(max_len=64, dim=8))
  with checkpointing.Checkpointer(
      tmp_path / 'checkpoints', max_to_keep=3
  ) as ck:
    _save(ck, 1, params, opt_state, _data_iter())
    _save(ck, 2, params, opt_state, _data_iter())
  _flip_params_byte(tmp_path / 'checkpoints' / '2')
  step_dir = str(tmp_path / 'checkpoints' / '2')
  # The flip lands wherever the file layout puts it: usually it decodes to other
  # values (caught by the checksum), sometimes it breaks the compressed frame (a
  # read error).
  with pytest.raises(
      checkpointing.CheckpointDamagedError, match='is damaged'
  ) as e:
    checkpointing.restore_params(tmp_path, step=2)
  assert step_dir in str(e.value)
  with caplog.at_level(logging.WARNING, logger=LOGGER):
    _, _, info = checkpointing.restore_params(tmp_path)
  assert info.step == 1 and [d['step'] for d in info.fell_back_from] == [2]
  assert step_dir in caplog.text and 'damaged' in caplog.text
  with checkpointing.Checkpointer(
      tmp_path / 'checkpoints', max_to_keep=3
  ) as ck:
    with pytest.raises(checkpointing.CheckpointDamagedError, match=step_dir):
      ck.restore(
          2,
          abstract_params=_abstract(params),
          abstract_opt_state=_abstract(opt_state),
          data_iter=_data_iter(),
      )
    r = ck.restore(
        abstract_params=_abstract(params),
        abstract_opt_state=_abstract(opt_state),
        data_iter=_data_iter(),
        fallback=True,
    )
    assert r['step'] == 1 and r['restore_info'].fell_back_from[0]['step'] == 2
    with pytest.raises(
        checkpointing.CheckpointDamagedError, match='previous checkpoint'
    ):
      ck.restore(
          abstract_params=_abstract(params),
          abstract_opt_state=_abstract(opt_state),
          data_iter=_data_iter(),
          fallback=False,
      )


def test_params_replaced_by_other_valid_bytes_fail_the_checksum(tmp_path):
  """Decodable bytes of other values (no format error at all) are still
  caught."""
  import shutil

  params, opt_state = _trained_state(_params())
  with checkpointing.Checkpointer(tmp_path, max_to_keep=3) as ck:
    _save(ck, 1, params, opt_state, None)
    _save(ck, 2, jax.tree.map(lambda x: x * 2, params), opt_state, None)
  shutil.rmtree(tmp_path / '1' / 'params')
  shutil.copytree(tmp_path / '2' / 'params', tmp_path / '1' / 'params')
  with pytest.raises(
      checkpointing.CheckpointDamagedError, match='pos_embed/embedding'
  ):
    checkpointing.restore_params(tmp_path, step=1)


def test_another_models_checkpoint_is_a_mismatch_not_damage(tmp_path, caplog):
  params, opt_state = _trained_state(_params(max_len=8))
  with checkpointing.Checkpointer(tmp_path, max_to_keep=3) as ck:
    _save(ck, 1, params, opt_state, None)
    _save(ck, 2, params, opt_state, None)
  bigger, bigger_opt = _trained_state(_params(max_len=16))
  with checkpointing.Checkpointer(tmp_path, max_to_keep=3) as ck:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
      with pytest.raises(checkpointing.CheckpointMismatchError) as e:
        ck.restore(
            abstract_params=_abstract(bigger),
            abstract_opt_state=_abstract(bigger_opt),
            data_iter=None,
        )
  assert not isinstance(e.value, checkpointing.CheckpointDamagedError)
  assert 'damaged' not in caplog.text and 'corrupt' not in str(e.value)


def test_step_deleted_while_read_is_replaced_by_the_new_latest(
    tmp_path, monkeypatch, caplog
):
  """A trainer with max_to_keep=1 saves step 7 and deletes step 5 between the
  reader's listing and its restore: the reader reads step 7, never falls back to
  step 0."""
  params, opt_state = _trained_state(_params())
  writer = checkpointing.Checkpointer(tmp_path / 'checkpoints', max_to_keep=1)
  _save(writer, 0, _params(), opt_state, None)
  _save(writer, 5, params, opt_state, None)
  writer.wait_until_finished()
  real = checkpointing.Checkpointer._read
  calls = []

  def racing(self, step, **kw):
    calls.append(step)
    # the trainer moves on while the reader holds step 5's listing
    if step == 5:
      _save(writer, 7, jax.tree.map(lambda x: x + 1, params), opt_state, None)
      writer.wait_until_finished()
      assert not (tmp_path / 'checkpoints' / '5').exists()
    return real(self, step, **kw)

  monkeypatch.setattr(checkpointing.Checkpointer, '_read', racing)
  with caplog.at_level(logging.WARNING, logger=LOGGER):
    restored, _, info = checkpointing.restore_params(tmp_path)
  writer.close()
  assert calls == [5, 7]
  assert info.step == 7 and info.vanished == [5] and info.fell_back_from == []
  _assert_trees_equal(restored, jax.tree.map(lambda x: x + 1, params))
  assert 'deleted or superseded' in caplog.text


def test_a_step_deleted_while_the_reader_lists_them_is_listed_again(
    tmp_path, monkeypatch
):
  """The trainer saves step 7 and deletes step 5 after the reader found the
  step directories but before Orbax read their metadata: the reader lists
  again and reads step 7 (not a raw FileNotFoundError)."""
  import orbax.checkpoint as ocp

  params, opt_state = _trained_state(_params())
  writer = checkpointing.Checkpointer(tmp_path / 'checkpoints', max_to_keep=1)
  _save(writer, 0, _params(), opt_state, None)
  _save(writer, 5, params, opt_state, None)
  writer.wait_until_finished()
  step_format = type(ocp.step.standard_name_format())
  real = step_format.find_all
  listings = []

  def racing(self, base_path):
    found = list(real(self, base_path))
    listings.append(sorted(m.step for m in found))
    if len(listings) == 1:
      _save(writer, 7, jax.tree.map(lambda x: x + 1, params), opt_state, None)
      writer.wait_until_finished()
    return found

  monkeypatch.setattr(step_format, 'find_all', racing)
  restored, _, info = checkpointing.restore_params(tmp_path)
  writer.close()
  assert listings[:2] == [[0, 5], [0, 7]]
  assert info.step == 7 and info.vanished == []
  _assert_trees_equal(restored, jax.tree.map(lambda x: x + 1, params))


def test_max_to_keep_below_one_is_refused_by_the_run_config():
  from flax_posemb import config as config_lib

  with pytest.raises(ValueError, match='max_to_keep must be >= 1, got 0'):
    config_lib.RunConfig(max_to_keep=0)


def test_a_reader_names_each_damaged_step_and_fails_if_all_are_damaged(
    tmp_path, monkeypatch
):
  """Two damaged newest steps are both damage (not 'deleted while read'); with
  every step damaged the reader names one, never 'no checkpoint'."""
  params, opt_state = _trained_state(_params())
  with checkpointing.Checkpointer(
      tmp_path / 'checkpoints', max_to_keep=5
  ) as writer:
    for step in (0, 5, 7):
      _save(writer, step, params, opt_state, None)
  real = checkpointing.Checkpointer._read
  damaged = {5, 7}

  def read(self, step, **kw):
    if step in damaged:
      raise checkpointing.CheckpointDamagedError(f'step {step} is garbled')
    return real(self, step, **kw)

  monkeypatch.setattr(checkpointing.Checkpointer, '_read', read)
  _, _, info = checkpointing.restore_params(tmp_path)
  assert info.step == 0 and info.vanished == []
  assert [d['step'] for d in info.fell_back_from] == [7, 5]
  damaged.add(0)
  with pytest.raises(
      checkpointing.CheckpointDamagedError, match='checkpoints/0 is damaged'
  ):
    checkpointing.restore_params(tmp_path)


def test_metrics_are_stored_with_the_step(tmp_path):
  params, opt_state = _trained_state(_params())
  with checkpointing.Checkpointer(tmp_path, max_to_keep=3) as ck:
    assert ck.save(
        2,
        params=params,
        opt_state=opt_state,
        data_iter=None,
        stats=None,
        config={},
        metrics={'loss': 5.0},
    )
  with checkpointing.Checkpointer(tmp_path, max_to_keep=3) as ck:
    assert ck.step_metadata(2)['metrics'] == {'loss': 5.0}


def _step_metadata_file(step_dir):
  # Orbax's per-step metadata (holds the digests)
  return step_dir / '_CHECKPOINT_METADATA'


@pytest.mark.parametrize('damage', ['missing', 'garbled'])
def test_damaged_step_metadata_is_damage_not_a_step_without_digests(
    tmp_path, caplog, damage
):
  """Without its metadata file a step's digests cannot be checked: flipped bytes
  would be restored silently, so the step is damaged (and skipped by a
  fallback), not unverified."""
  params, opt_state = _trained_state(_params())
  with checkpointing.Checkpointer(
      tmp_path / 'checkpoints', max_to_keep=3
  ) as ck:
    _save(ck, 1, params, opt_state, _data_iter())
    _save(ck, 2, jax.tree.map(lambda x: x + 1, params), opt_state, _data_iter())
  meta = _step_metadata_file(tmp_path / 'checkpoints' / '2')
  if damage == 'missing':
    meta.unlink()
  else:
    meta.write_text(meta.read_text()[:40])
  with pytest.raises(
      checkpointing.CheckpointDamagedError, match='_CHECKPOINT_METADATA'
  ):
    checkpointing.restore_params(tmp_path, step=2)
  with caplog.at_level(logging.WARNING, logger=LOGGER):
    restored, _, info = checkpointing.restore_params(tmp_path)
  assert info.step == 1 and str(tmp_path / 'checkpoints' / '2') in caplog.text
  _assert_trees_equal(restored, params)
  with checkpointing.Checkpointer(
      tmp_path / 'checkpoints', max_to_keep=3
  ) as ck:
    with pytest.raises(
        checkpointing.CheckpointDamagedError, match='_CHECKPOINT_METADATA'
    ):
      ck.restore(
          abstract_params=_abstract(params),
          abstract_opt_state=_abstract(opt_state),
          data_iter=_data_iter(),
          fallback=False,
      )


def test_a_step_saved_before_digests_is_restored(
    tmp_path,
):
  params, opt_state = _trained_state(_params())
  with checkpointing.Checkpointer(
      tmp_path / 'checkpoints', max_to_keep=3
  ) as ck:
    _save(ck, 1, params, opt_state, _data_iter())
  meta = _step_metadata_file(tmp_path / 'checkpoints' / '1')
  record = json.loads(meta.read_text())
  del record['custom_metadata']['integrity']  # as written by an older version
  meta.write_text(json.dumps(record))
  restored, _, info = checkpointing.restore_params(tmp_path)
  assert info.step == 1
  _assert_trees_equal(restored, params)
  with checkpointing.Checkpointer(
      tmp_path / 'checkpoints', max_to_keep=3
  ) as ck:
    r = ck.restore(
        abstract_params=_abstract(params),
        abstract_opt_state=_abstract(opt_state),
        data_iter=_data_iter(),
    )
  assert r['step'] == 1


def test_a_checkpoint_that_cannot_fit_is_refused_before_anything_is_written(
    tmp_path, monkeypatch
):
  """ENOSPC from the caller's thread, naming the need and the free space:
  started, the save would fail in Orbax's writer threads instead (a traceback
  from each of their writes)."""
  params, opt_state = _trained_state(_params())
  with checkpointing.Checkpointer(tmp_path, max_to_keep=3) as ck:
    _save(ck, 1, params, opt_state, None)
    ck.wait_until_finished()
    monkeypatch.setattr(
        checkpointing.shutil,
        'disk_usage',
        lambda path: type('Usage', (), {'free': 100})(),
    )
    with pytest.raises(
        OSError,
        match=r'step 2: it needs up to .* MB and .* has 0.0 MB free.*'
        r'resumes from the last checkpoint',
    ) as e:
      _save(ck, 2, params, opt_state, None)
    assert e.value.errno == errno.ENOSPC and ck.all_steps() == [1]
  # nothing written
  assert not [p for p in tmp_path.iterdir() if p.name.startswith('2')]


def test_a_read_failure_that_is_not_about_the_files_is_not_called_damage(
    tmp_path, monkeypatch
):
  """Out of memory (a RuntimeError of the device, at the root of Orbax's
  wrapper) propagates as it is: no warning, no fallback, never
  CheckpointDamagedError."""
  import orbax.checkpoint as ocp

  params, opt_state = _trained_state(_params())
  with checkpointing.Checkpointer(tmp_path, max_to_keep=3) as ck:
    _save(ck, 1, params, opt_state, None)
    _save(ck, 2, params, opt_state, None)

  def out_of_memory(*args, **kwargs):
    raise Exception('restore failed') from RuntimeError(
        'RESOURCE_EXHAUSTED: out of memory'
    )

  monkeypatch.setattr(ocp.CheckpointManager, 'restore', out_of_memory)
  with pytest.raises(Exception, match='restore failed') as e:
    checkpointing.restore_params(tmp_path)
  assert not isinstance(e.value, checkpointing.CheckpointDamagedError)
