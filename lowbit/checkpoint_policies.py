"""Remat policies that keep lowbit's GEMM outputs instead of recomputing them.

JAX's `checkpoint_dots` looks for `dot_general`; lowbit's GEMMs are FFI custom calls it
does not see, so under it they would be recomputed in the backward pass. lowbit tags every
GEMM output with `jax.ad_checkpoint.checkpoint_name(..., "lowbit_gemm")`; these policies
save those names as well as what the JAX policy saves. Use them in place of JAX's:

    jax.checkpoint(f, policy=lowbit.checkpoint_policies.checkpoint_dots_and_lowbit_gemms)
"""

from __future__ import annotations

import jax

from lowbit.dense import GEMM_CHECKPOINT_NAME

_cp = jax.checkpoint_policies

lowbit_gemms_saveable = _cp.save_only_these_names(GEMM_CHECKPOINT_NAME)
checkpoint_dots_and_lowbit_gemms = _cp.save_from_both_policies(_cp.checkpoint_dots, lowbit_gemms_saveable)
dots_and_lowbit_gemms_with_no_batch_dims = _cp.save_from_both_policies(
    _cp.dots_with_no_batch_dims_saveable, lowbit_gemms_saveable
)

# TransformerEngine's spellings, for code ported by changing its imports.
checkpoint_dots_and_te_gemms = checkpoint_dots_and_lowbit_gemms
dots_and_te_gemms_with_no_batch_dims = dots_and_lowbit_gemms_with_no_batch_dims
te_gemms_saveable = lowbit_gemms_saveable

__all__ = [
    "lowbit_gemms_saveable",
    "checkpoint_dots_and_lowbit_gemms",
    "dots_and_lowbit_gemms_with_no_batch_dims",
    "checkpoint_dots_and_te_gemms",
    "dots_and_te_gemms_with_no_batch_dims",
    "te_gemms_saveable",
]
