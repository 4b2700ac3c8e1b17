# origin: considered alternative
# what I believed: the norms are element-wise per position; the activation arriving at each block is already the
#   local [b, s/tp, h] shard (tok/wo/w2 reduce-scatter it), so a plain RMSNorm computes the right values on it and
#   SequenceParallel() on the norms is redundant (PrepareModuleInput already says the input is Shard(1)).
# visible check said: AssertionError: rank 0: layers.0.attention_norm.weight's gradient differs from one process's on the whole batch
# grader said: 0/5, same message "(check line 22) The check compared the hidden check's results with the solution's, case by case: a hidden case first differs: values that differ beyond the tolerance." (no misconception named)
# misconception: a plain norm on a sequence shard computes the right activations but its weight gradient is only this rank's positions' share; SequenceParallel() makes the weight a Replicate DTensor so that its gradient is summed (all-reduced) over tp.
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts


def parallelize(model, mesh):
    """A GPT-like model (tok, pos, layers of attention and feed_forward sub-blocks, norm, output) on a ("dp", "tp")
    mesh: torchtitan's plan derived from the model, tensor and sequence parallelism with loss parallelism, then
    selective recompute of each block, then FSDP units. Returns the model."""
    if tuple(mesh.mesh_dim_names or ()) != ("dp", "tp"):
        raise ValueError(f"expected a mesh named ('dp', 'tp'), got {mesh.mesh_dim_names}")
    tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    # outside the blocks: embeddings split by rows, outputs reduce-scattered over the sequence
    parallelize_module(model, tp_mesh, {
        "tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "pos": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    for name, block in model.layers.items():
        plan = {
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        }
        for sub in ("attention", "feed_forward"):
            for lname, lin in getattr(block, sub).named_children():
                if isinstance(lin, nn.Linear):
                    if lname in ("wo", "w2"):
                        plan[f"{sub}.{lname}"] = RowwiseParallel(output_layouts=Shard(1))
                    else:
                        plan[f"{sub}.{lname}"] = ColwiseParallel()
        parallelize_module(block, tp_mesh, plan)

    save = {torch.ops.aten.mm.default, torch.ops._c10d_functional.reduce_scatter_tensor.default}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    for name in list(model.layers.keys()):
        wrapped = checkpoint_wrapper(model.layers[name],
                                     context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
        model.layers[name] = wrapped
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh)
    fully_shard([model.tok, model.pos], mesh=dp_mesh)
    fully_shard([model.norm, model.output], mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model
