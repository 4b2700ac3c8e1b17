# origin: considered alternative
# what I believed: FSDP2's parameters are DTensors, so model.state_dict() and optimizer.state_dict() are already sharded state dicts that dcp.save/dcp.load handle; get_state_dict is only a convenience, and load fills the fresh optimizer's state dict in place like the model's
# visible check said: AssertionError: after loading on 3 ranks, 0.weight has no optimizer state 'step'
# grader said: 0/4 — WrongCases: `on3` does not hold the cases the check asked for: a key missing, which the check asked for
# misconception: A freshly built optimizer has no state yet, so optimizer.state_dict() gives dcp.load nothing to fill in (and is keyed by parameter index, not name): get_state_dict(model, optimizer) initialises the optimizer state and uses the parameters' names, and set_state_dict puts it back.
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def save_sharded(model, optimizer, step, path):
    # FSDP2's parameters are DTensors already: the plain state dicts are sharded, DCP writes them as they are
    dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step}, checkpoint_id=path)


def load_sharded(model, optimizer, path):
    state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": 0}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])
    return state["step"]
