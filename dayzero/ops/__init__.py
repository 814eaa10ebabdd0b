"""Compute ops: one folder per op, each with a ``reference.py`` (pure PyTorch, fp32 accumulation)."""
from dayzero.ops.registry import call, register, registered, table  # noqa: F401

# Importing the reference modules registers them.
from dayzero.ops.activation import reference as _activation  # noqa: F401,E402
from dayzero.ops.attention import reference as _attention  # noqa: F401,E402
from dayzero.ops.attention import latent as _latent  # noqa: F401,E402
from dayzero.ops.hyper import reference as _hyper  # noqa: F401,E402
from dayzero.ops.indexer import reference as _indexer  # noqa: F401,E402
from dayzero.ops.kda import reference as _kda  # noqa: F401,E402
from dayzero.ops.kda import step as _kda_step  # noqa: F401,E402
from dayzero.ops.linear import reference as _linear  # noqa: F401,E402
from dayzero.ops.moe import reference as _moe  # noqa: F401,E402
from dayzero.ops.moe import cuda as _moe_cuda  # noqa: F401,E402
from dayzero.ops.norm import reference as _norm  # noqa: F401,E402
from dayzero.ops.rotary import reference as _rotary  # noqa: F401,E402
from dayzero.ops.sampling import reference as _sampling  # noqa: F401,E402
from dayzero.ops.ssd import reference as _ssd  # noqa: F401,E402
from dayzero.ops.step import reference as _step  # noqa: F401,E402

# Batch-wide ops (one call per layer over the whole step) and their device implementations.
from dayzero.ops.attention import paged as _paged  # noqa: F401,E402
from dayzero.ops.attention import cuda as _attention_cuda  # noqa: F401,E402
from dayzero.ops.attention import compressed_cuda as _compressed_cuda  # noqa: F401,E402
from dayzero.ops.attention import vision as _vision  # noqa: F401,E402
from dayzero.ops.indexer import cuda as _indexer_cuda  # noqa: F401,E402
from dayzero.ops.kda import cuda as _kda_cuda  # noqa: F401,E402
from dayzero.ops.kda import cpu as _kda_cpu  # noqa: F401,E402
from dayzero.ops.ssd import cuda as _ssd_cuda  # noqa: F401,E402

# Triton kernels (registered for the cuda platform; each refuses, with its reason, where Triton cannot run).
from dayzero.ops.norm import kernels as _norm_kernels  # noqa: F401,E402
from dayzero.ops.linear import kernels as _linear_kernels  # noqa: F401,E402
from dayzero.ops.linear import norm as _linear_norm  # noqa: F401,E402
from dayzero.ops.linear import act as _linear_act  # noqa: F401,E402
from dayzero.ops.sampling import kernels as _sampling_kernels  # noqa: F401,E402
from dayzero.ops.rotary import kernels as _rotary_kernels  # noqa: F401,E402
from dayzero.ops.step import kernels as _step_kernels  # noqa: F401,E402
from dayzero.ops.attention import latent_kernels as _latent_kernels  # noqa: F401,E402
from dayzero.ops.activation import kernels as _activation_kernels  # noqa: F401,E402
from dayzero.ops.moe import route_kernels as _route_kernels  # noqa: F401,E402
from dayzero.ops.moe import router_kernels as _router_kernels  # noqa: F401,E402
from dayzero.ops.moe import unpermute_kernels as _unpermute_kernels  # noqa: F401,E402
from dayzero.ops.moe import permute_kernels as _permute_kernels  # noqa: F401,E402
from dayzero.ops.kda import gate_kernels as _gate_kernels  # noqa: F401,E402
from dayzero.ops.kda import decode_kernels as _kda_decode_kernels  # noqa: F401,E402
