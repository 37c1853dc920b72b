"""PyTorch integration (needs torch; ``import smartcoll`` alone does not).

    import smartcoll.torch                      # registers the torch.distributed backend "smartcoll"
    dist.init_process_group(backend="smartcoll")
    model = DDP(model)

    # or keep gloo and let smartcoll all-reduce DDP's gradient buckets:
    model.register_comm_hook(None, smartcoll.torch.allreduce_hook(codec="bfp16"))

See docs/torch.md.
"""

from ._backend import ProcessGroupSmartcoll
from ._hook import allreduce_hook
from ._work import Work

__all__ = ["ProcessGroupSmartcoll", "Work", "allreduce_hook"]
