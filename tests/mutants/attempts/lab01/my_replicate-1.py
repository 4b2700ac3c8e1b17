# origin: considered alternative
# what I believed: buffers follow the same rule as parameters: the replica on the device where the buffer already lives uses the original tensor (so its updates persist), every other device gets a detached copy; on real GPUs that is the first device anyway.
# visible check said: AssertionError: the first replica uses the module's own buffers, the others detached copies
# grader said: 0/3 AssertionError: the first replica uses the module's own buffers, the others detached copies (check line 34)   [graded with --no-sandbox: the sandboxed judge of lab 01 hangs, see report]
# misconception: "where the buffer lives" is not "the first replica": on virtual devices (all cpu) every replica would alias the module's running statistics and all of them would update it; only replica 0 may alias a buffer, by position, not by device.
def my_replicate(module, devices, dtype=None):
    """One replica of module per device; gradients of the replicas flow back to module.
    With dtype, the replicas' floating-point parameters are dtype copies (BatchNorm's stay as they are)."""
    replicas = []
    for i, device in enumerate(devices):
        def copy(m):
            r = m.__new__(type(m))
            r.__dict__ = m.__dict__.copy()
            r._parameters, r._buffers, r._modules = {}, {}, {}
            is_bn = isinstance(m, nn.modules.batchnorm._BatchNorm)
            for name, p in m._parameters.items():
                if p is None:
                    r._parameters[name] = None
                elif dtype is not None and p.is_floating_point() and not is_bn:
                    r._parameters[name] = p.to(device, dtype)
                elif p.device == torch.device(device):
                    r._parameters[name] = p.view_as(p)
                else:
                    r._parameters[name] = p.to(device)
            for name, b in m._buffers.items():
                if b is None:
                    r._buffers[name] = None
                elif b.device == torch.device(device):   # the original where it already lives, like view_as for parameters
                    r._buffers[name] = b
                else:
                    r._buffers[name] = b.detach().to(device, copy=True)
            for name, sub in m._modules.items():
                r._modules[name] = None if sub is None else copy(sub)
            return r
        replicas.append(copy(module))
    return replicas
