"""Imports a local Hugging Face GPT-2-family checkpoint as a workdir that
eval.py evaluates and train.py starts from (docs/pretrained.md; the
library call: `flax_posemb.hf_import.import_checkpoint`).

  python -m flax_posemb.commands.import_hf --hf_dir ~/models/gpt2 \
      --workdir runs/gpt2 --config configs/gpt2_pretrained.py
  python eval.py --workdir runs/gpt2

DIR holds config.json, model.safetensors (the hub's PyTorch names) or
flax_model.msgpack, and the tokenizer (tokenizer.json, or vocab.json +
merges.txt). The config file gives everything but the model's shape: data,
evaluation, dtypes; a data.seq_len above the checkpoint's positions follows
them (one log line says so). Built aside and swapped in when complete: an
interrupted or failed import leaves nothing in the way of the same command.
Exit codes (flax_posemb.cli): 0 done, 2 bad input (one message naming the file
and the problem; --debug shows the traceback), 75 stopped by SIGTERM (nothing
left; re-run the same command).
"""

import signal

# Held, not lost, until the one handler takes it (in main).
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

from absl import flags
from ml_collections import config_flags

from flax_posemb import cli
from flax_posemb import hf_import
from flax_posemb import preemption

PROG = 'python -m flax_posemb.commands.import_hf'
cli.name_main_module(PROG, __name__)

_HF_DIR = flags.DEFINE_string(
    'hf_dir',
    None,
    'Local Hugging Face model directory (config.json, model.safetensors or'
    ' flax_model.msgpack, tokenizer files).',
)
_WORKDIR = flags.DEFINE_string(
    'workdir', None, 'The new workdir (absent or empty).'
)
_CONFIG = config_flags.DEFINE_config_file(
    'config',
    None,
    'Config file for data, evaluation and dtypes (configs/NAME.py); the model'
    " shape is the checkpoint's.",
    lock_config=True,
)
cli.define_debug_flag()
flags.mark_flags_as_required(['hf_dir', 'workdir', 'config'])


def main(argv):
  del argv  # cli.run refuses positional arguments.
  cli.check_output_dir(_WORKDIR.value)
  replaced = preemption.install_handler()
  try:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    record = hf_import.import_checkpoint(
        _HF_DIR.value, _WORKDIR.value, _CONFIG.value
    )
  except preemption.Preempted:
    cli.fail(
        PROG,
        f'SIGTERM: the import stopped and left nothing in {_WORKDIR.value}.'
        ' Re-run the same command.',
        cli.EXIT_PREEMPTED,
    )
  finally:
    signal.signal(signal.SIGTERM, replaced)
  model = record['model']
  print(
      f"imported {record['parameters']:,} parameters ({model['num_layers']}"
      f" layers, width {model['emb_dim']}, {model['max_len']} positions) from"
      f" {', '.join(record['files'])} into {_WORKDIR.value}; tokenizer"
      f" {', '.join(record['tokenizer']['files'][:2])}, separator id"
      f" {record['tokenizer']['separator_id']}."
  )
  # The probe's shift: a quarter of the positions (0,256 for GPT-2's 1024).
  shift = max(1, model['max_len'] // 4)
  print(
      f'Evaluate it: python eval.py --workdir {_WORKDIR.value} [--offsets'
      f' 0,{shift} --analyze]'
  )


if __name__ == '__main__':
  cli.run(main, PROG)
