# origin: considered alternative
# what I believed: ColwiseParallel has an input_layouts argument, so each column-parallel projection can take the
#   sequence-sharded activation itself (input_layouts=Shard(1)) and gather it; no PrepareModuleInput needed on the
#   sub-block. Same numbers, fewer lines.
# visible check said: AssertionError: rank 0: forward collectives {'dp all-gather': 4, 'tp all-gather': 9, 'tp reduce-scatter': 6, 'bmm': 4, 'mm': 13}: expected no all-reduce, one all-gather of the sequence over tp before each sub-block and before the output projection
# grader said: 0/5, same message "(check line 40) The check compared the hidden check's results with the solution's, case by case: a hidden case first differs: values that differ beyond the tolerance." (no misconception named)
# misconception: each column-parallel linear that gathers its own input all-gathers the same sequence once per projection (wq, wk, wv: 3 times per attention), where gathering once at the sub-block's input (PrepareModuleInput) serves them all.
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
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    for name, block in model.layers.items():
        plan = {
            "attention_norm": SequenceParallel(),
            "ffn_norm": SequenceParallel(),
        }
        for sub in ("attention", "feed_forward"):
            for lname, lin in getattr(block, sub).named_children():
                if isinstance(lin, nn.Linear):
                    if lname in ("wo", "w2"):
                        plan[f"{sub}.{lname}"] = RowwiseParallel(output_layouts=Shard(1))
                    else:
                        plan[f"{sub}.{lname}"] = ColwiseParallel(input_layouts=Shard(1))
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
