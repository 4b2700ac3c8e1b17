# origin: considered alternative
# what I believed: whether I look for inf/NaN before or after multiplying by inv_scale makes no difference
#   (inf stays inf, NaN stays NaN, a finite number times 1/S stays finite), so I can unscale first and check the result.
# visible check said: ex2 passed
# grader said: 3/3 (full marks)
# misconception: a finite gradient can overflow while being unscaled (inv_scale > 1 once the scale has backed off
#   below 1, or an fp32/bf16 value near the format's max): the kernel's flag looks at the values before unscaling,
#   so checking the product flags a group that the kernel does not.
def unscale_grads_(groups, inv_scale):
    found_inf = torch.zeros(len(groups), dtype=torch.float32)
    for i, group in enumerate(groups):
        for g in group:
            g.mul_(inv_scale)
            if not torch.isfinite(g).all():
                found_inf[i] = 1.0
    return found_inf
