"""The `smartcoll` command and what it runs: the launcher (`smartcoll run`), `info`, `demo`, the benchmarks
(`bench`, with gloo and Open MPI as peers) and the emulated cluster (`netemu`, `smartcoll cluster`).

The library itself (smartcoll.init, the Communicator, codecs, knobs) does not depend on anything here.
"""
