# origin: considered alternative
# what I believed: the check's words 'the policy's other fields left at their defaults' meant: set param_dtype=bf16 and nothing else; I took reduce_dtype's default to be fp32 (the shards and the optimizer stay fp32)
# visible check said: ex6 passed — and it printed 'bf16 compute, fp32 reduce: losses within 0.5 % of DDP's: True'
# grader said: 0/5 — AssertionError: hidden check 1 of this cell failed
# misconception: MixedPrecisionPolicy's reduce_dtype defaults to None, which means 'follow param_dtype': the gradients are reduce-scattered (summed) in bf16; fp32 reduction must be asked for with reduce_dtype=torch.float32.
def shard_model(model, mesh, mixed_precision=False, reshard_after_forward=True):
    kwargs = dict(mesh=mesh, reshard_after_forward=reshard_after_forward)
    if mixed_precision:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16)   # the other fields at their defaults
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)          # the root: embed + head (tied) + the final norm
    return model
