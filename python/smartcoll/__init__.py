"""smartcoll: collective communication for distributed training on Ethernet.

    import smartcoll
    with smartcoll.init() as comm:          # env:// rendezvous (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
        comm.allreduce(grad)                 # in place, sum
        req = comm.iallreduce(bucket)        # non-blocking: the engine thread does the work
        ...                                  # keep computing
        req.wait()
"""

from . import codec
from ._comm import Communicator, Request, init
from ._core import CommError
from ._knobs import Knob, build_info, knobs
from ._onesided import Region, RemoteRegion

__version__ = build_info()["version"]

__all__ = ["CommError", "codec", "Communicator", "Knob", "Region", "RemoteRegion", "Request", "build_info", "init",
           "knobs", "__version__"]
