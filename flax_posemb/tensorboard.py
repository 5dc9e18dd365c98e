"""TensorBoard events written by the caller's thread a whole record at a time:
unlike with tensorboardX's SummaryWriter (its own thread), a failed write raises
in the caller, once."""

import os
import socket
import struct
import time
from typing import Any

from tensorboardX import summary
from tensorboardX.proto import event_pb2
from tensorboardX.record_writer import masked_crc32c
from tensorboardX.utils import figure_to_image

from flax_posemb import outputs


class TensorBoard:
  """Event file ``LOGDIR/events.out.tfevents.*`` in tensorboardX's format;
  ``add_*`` take tensorboardX ``SummaryWriter``'s arguments, so either can be a
  statistics writer."""

  def __init__(self, logdir: str, purge_step: int | None = None):
    os.makedirs(logdir, exist_ok=True)
    self.path = os.path.join(
        logdir, f'events.out.tfevents.{time.time():.0f}.{socket.gethostname()}'
    )
    self._add(file_version='brain.Event:2')
    # TensorBoard drops later events of an earlier attempt.
    if purge_step is not None:
      self._add(
          purge_step,
          session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START),
      )

  def _add(self, step: int = 0, summ: Any = None, **fields: Any) -> None:
    # None: no field
    data = event_pb2.Event(
        step=int(step), wall_time=time.time(), summary=summ, **fields
    ).SerializeToString()
    # TFRecord framing: length, crc, payload, crc
    head = struct.pack('<Q', len(data))
    outputs.append_whole(
        self.path,
        head
        + struct.pack('<I', masked_crc32c(head))
        + data
        + struct.pack('<I', masked_crc32c(data)),
    )

  def add_scalar(self, tag: str, value: float, global_step: int) -> None:
    """A scalar (the Scalars tab)."""
    self._add(global_step, summary.scalar(tag, value))

  def add_image(
      self,
      tag: str,
      img_tensor: Any,
      global_step: int,
      dataformats: str = 'CHW',
  ) -> None:
    """An image (the Images tab): uint8 or [0, 1] floats in `dataformats`."""
    self._add(
        global_step, summary.image(tag, img_tensor, dataformats=dataformats)
    )

  def add_figure(self, tag: str, figure: Any, global_step: int) -> None:
    """A matplotlib figure as an image (the figure is closed)."""
    self.add_image(tag, figure_to_image(figure), global_step)

  def add_hparams(
      self, hparams: dict[str, Any], metrics: dict[str, float]
  ) -> None:
    """Hyperparameters and final metrics in ``LOGDIR/hparams`` (TensorBoard's
    HParams tab), as tensorboardX's ``add_hparams(name='hparams')`` writes
    them."""
    run = TensorBoard(os.path.join(os.path.dirname(self.path), 'hparams'))
    # experiment, session start and end
    for s in summary.hparams(hparams, metrics):
      run._add(0, s)
    for k, v in metrics.items():
      run.add_scalar(k, v, 0)
