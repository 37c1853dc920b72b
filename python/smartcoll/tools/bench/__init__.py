"""`smartcoll bench`: time a collective over a range of sizes, check its results, compare with gloo and MPI.

Shape of a run (nccl-tests' figures, the peers of DESIGN.md measured side by side):

* the driver (``main``) resolves the sizes, writes a config into a scratch directory and launches N ranks of
  ``python -m smartcoll.tools.bench --worker DIR`` through the launcher;
* each worker times smartcoll (and, with ``--vs gloo``, torch.distributed/gloo in the same processes, on the
  same buffers), checks the results against values it can compute itself, and writes its own per-size times
  and wrong-element counts to ``DIR/<impl>.rank<K>.json``;
* with ``--vs mpi`` the driver then runs the same loop under mpirun (``peers``);
* the driver takes, per size, the max over ranks of the mean per-iteration time and the sum of wrong elements,
  and prints the table (and the JSON file).

With ``--cluster NAME`` every rank (smartcoll and gloo through the launcher's per-rank hooks, Open MPI through
an mpirun started inside host 0's namespace, see ``peers.run_mpi``) runs on its own host of an emulated
cluster (smartcoll.tools.netemu), and the driver first measures what the links carry (iperf3, ring pattern) so that
busbw is reported as a percentage of it.

Reducing the per-rank figures in the driver, rather than with the library under test, keeps a bug in the
library's own max-reduction from corrupting its report, and treats smartcoll and its peers identically.

Modules: ``sizes`` (size options, tables), ``runners`` (collectives, buffers, the timing loop, a rank's
worker), ``report`` (per-rank files combined, the table, the JSON metadata), ``cli`` (the options and the
driver), ``peers`` (gloo, Open MPI), ``codec`` (``smartcoll bench codec``: the wire codecs' speed). This
package re-exports the names other code uses.
"""

from .cli import add_arguments, core_missing, main, measure_link
from .report import aggregate, build_rows, format_report, metadata
from .runners import (
    COLLECTIVES, DTYPES, MIN_ITERS, OPS, Case, Collective, SmartcollRunner, _NUMPY_OPS, bandwidths,
    busbw_factor, check, element_count, iterations, load_config, pattern, run_sizes, size_iterations,
    split_rounds, status, time_calls, worker_main,
)
from .sizes import format_size, format_table, parse_size, parse_sizes
