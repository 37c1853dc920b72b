"""`python -m smartcoll.tools.netemu up|down|status|fault|iperf`: the same as `smartcoll cluster ...`."""

import argparse
import sys

from .cli import add_arguments, run_cli

parser = argparse.ArgumentParser(prog="python -m smartcoll.tools.netemu")
add_arguments(parser)
sys.exit(run_cli(parser.parse_args()))
