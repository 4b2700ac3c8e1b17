# origin: considered alternative
# what I believed: section 6, step 4: "wait for each bucket, divide by the world size, copy the averages back into
#   the .grads" -- the bucket is an average over the ranks, so finish divides by the world size.
# visible check said: AssertionError: 2 buckets, rank 0: differs from one process on the full batch by 4.66e-01
# grader said: 0/5 AssertionError: 2 buckets, rank 0: differs from one process on the full batch by 4.66e-01 (check line 18) The check compared `runs` and the hidden check's results with the solution's, case by case: `runs['1 per parameter'][0][0]['embed.weight']` is the first to differ: values that differ beyond the tolerance (norm: expected 22.9121, got 22.4801).
# misconception: the buckets were weighted by each rank's num_samples before the all-reduce, so the sum must be divided by the total count N, not by the world size (that is the unweighted DDP of section 6).
class MyBucketedDDP(nn.Module):
    def __init__(self, module, bucket_names):
        # bucket_names: lists of parameter names, in launch order (what make_buckets returns)
        super().__init__()
        self.module = module
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t, src=0)  # every replica starts from rank 0's weights
        params = dict(module.named_parameters())
        self.buckets = [[params[name] for name in names] for names in bucket_names]
        self.bucket_of = {p: b for b, bucket in enumerate(self.buckets) for p in bucket}
        self.ready = [0] * len(self.buckets)  # gradients ready, per bucket, in this backward
        self.next_bucket = 0                  # the next bucket to launch (in order, on every rank)
        self.pending = []                     # (work, flat, bucket index) launched, not yet waited for
        for p in self.bucket_of:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def forward(self, x, *args, **kwargs):
        self.num_samples = len(x)             # this rank's samples in this step
        return self.module(x, *args, **kwargs)

    def _on_grad_ready(self, param):
        self.ready[self.bucket_of[param]] += 1
        while self.next_bucket < len(self.buckets) and \
                self.ready[self.next_bucket] == len(self.buckets[self.next_bucket]):
            b = self.next_bucket
            flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[b]]) * self.num_samples
            work = dist.all_reduce(flat, async_op=True)
            self.pending.append((work, flat, b))
            self.next_bucket += 1

    @torch.no_grad()
    def finish_gradient_synchronization(self):
        total = torch.tensor(float(self.num_samples), device=next(self.module.parameters()).device)
        dist.all_reduce(total)                # N: every rank's samples
        total = total.item()
        for work, flat, b in self.pending:
            work.wait()
            flat /= dist.get_world_size()
            offset = 0
            for p in self.buckets[b]:
                n = p.numel()
                p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
                offset += n
        self.pending = []
        self.ready = [0] * len(self.buckets)
        self.next_bucket = 0
