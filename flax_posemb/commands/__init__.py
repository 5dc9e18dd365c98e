"""Command-line programs of the runner side: each parses its flags and makes
one library call (docs/DESIGN.md § Layout). The core library never imports them.

  python -m flax_posemb.commands.data_report  the position-exposure report
  python -m flax_posemb.commands.prepare      your own text as a TFDS dataset
  python -m flax_posemb.commands.import_hf    a Hugging Face GPT-2 as a workdir
"""
