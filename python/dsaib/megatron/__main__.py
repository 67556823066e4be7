"""python -m dsaib.megatron [--attention cudnn|tilelang] [--order ORDER] SCRIPT [ARGS...]

Runs a Megatron training script (e.g. Megatron-LM's $MEGATRON_LM/pretrain_gpt.py) as ``python SCRIPT
ARGS`` would, after dsaib.megatron.register(), so that its command line takes
``--dsa-kernel-backend dsaib`` without an edit to the script."""

import argparse
import runpy
import sys

from ._register import register


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m dsaib.megatron", description=__doc__.split("\n\n")[1])
    parser.add_argument("--attention", choices=("cudnn", "tilelang"), default=None,
                        help="the main sparse attention's backend (default: Megatron's torch code)")
    parser.add_argument("--order", choices=("logit_descending", "id_ascending"), default=None,
                        help="the order of each row's ids (default: id_ascending with cudnn, else logit_descending)")
    parser.add_argument("script", help="the training script, run as __main__")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    a = parser.parse_args(argv)
    register(attention=a.attention, order=a.order)
    sys.argv = [a.script] + a.args
    runpy.run_path(a.script, run_name="__main__")


if __name__ == "__main__":
    main()
