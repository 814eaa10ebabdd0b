"""Process groups and the few collectives the model calls. Nothing else in the package imports ``torch.distributed``.

The model is built with one :class:`ParallelState` and calls :func:`tp_all_reduce` / :func:`tp_all_gather`
with it; at tp=1 (:data:`SINGLE`, the default) both return their input, so the single-device path runs no
collective and touches no process group.
"""
from dayzero.distributed.state import (SINGLE, ParallelState, check_layout, current, destroy_parallel, divide,
                                       ep_all_gather, ep_all_to_all, etp_all_reduce, expert_tp_ranks, init_parallel,
                                       pipeline_stages, pp_broadcast_last, pp_recv, pp_send, tp_all_gather,
                                       tp_all_reduce)

__all__ = ["SINGLE", "ParallelState", "check_layout", "current", "destroy_parallel", "divide", "ep_all_gather",
           "ep_all_to_all", "etp_all_reduce", "expert_tp_ranks", "init_parallel", "pipeline_stages", "pp_broadcast_last", "pp_recv", "pp_send", "tp_all_gather", "tp_all_reduce"]
