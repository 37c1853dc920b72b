"""`python -m smartcoll.tools.bench --worker DIR`: one rank of a bench run (the driver starts them)."""

import sys

from .runners import worker_main

sys.exit(worker_main(sys.argv[1:]))
