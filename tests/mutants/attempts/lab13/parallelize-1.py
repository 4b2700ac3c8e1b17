# origin: considered alternative
# lab version: written from labs/13_capstone.ipynb as of cd37218, before 920d682 (that text named the ops "aten.mm", "aten.bmm", ... and said to keep bmm)
# what I believed: the lab names the operators "aten.mm", "aten.bmm", "_c10d_functional.all_reduce", so the policy can compare op with torch.ops.aten.mm etc. (I hesitated between these and the .default overloads torchtitan lists, and tried the lab's spelling).
# visible check said: parallelize passed
# grader said: parallelize_test 0/5 AssertionError: hidden check 3 of this cell failed
# misconception: the selective-checkpoint policy is called with an OpOverload (aten.mm.default), which never equals the OpOverloadPacket torch.ops.aten.mm, so nothing is MUST_SAVE: the block is recomputed whole and the tensor-parallel all-reduces run again in backward (10 all-reduces in backward instead of 8).
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts


def parallelize(model, mesh):
    """GPT on a ("dp", "tp") mesh: each block's tensor-parallel plan on mesh["tp"], then selective recompute of
    each block, then fully_shard of each block and of the root on mesh["dp"]. Returns the model."""
    if tuple(mesh.mesh_dim_names or ()) != ("dp", "tp"):
        raise ValueError(f"expected a mesh named ('dp', 'tp'), got {mesh.mesh_dim_names}")
    plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(), "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel()}
    save = {torch.ops.aten.mm, torch.ops.aten.bmm,
            torch.ops._c10d_functional.all_reduce, torch.ops._c10d_functional.wait_tensor}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    for name in list(model.layers.keys()):
        block = model.layers[name]
        parallelize_module(block, mesh["tp"], plan)
        block = checkpoint_wrapper(block, context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
        fully_shard(block, mesh=mesh["dp"])
        model.layers[name] = block
    fully_shard(model, mesh=mesh["dp"])
    return model
