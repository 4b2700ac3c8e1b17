# origin: considered alternative
# what I believed: a loss weight of 1e-3 on the MSE (1024 x 64 outputs, targets x @ W of size ~4) makes the output
#   gradients 2*err/65536*1e-3 ~ 1e-7 small enough to flush to zero in fp16, so fp16 without a scaler stops training.
# visible check said: AssertionError: fp16 without a scaler did not visibly fail: its last loss is within 2x of fp32's
#   (printed: fp32 first loss 1.6e-02 last loss 1.4e-03; fp16, no scaler first loss 1.6e-02 last loss 1.4e-03;
#    fp16 + LossScaler first loss 1.6e-02 last loss 1.4e-03)
# grader said: 0/3 AssertionError: fp16 without a scaler did not visibly fail: its last loss is within 2x of fp32's (check line 27) The check compared `setting` with the solution's, case by case: `setting['loss_weight']` is the first to differ: its value: expected 1e-05.
# misconception: gradients around 1e-7 are still above fp16's smallest subnormal 2^-24 (6e-8) and, with Adam
#   normalising by their RMS, a handful of surviving subnormal digits still trains: the gradients must lie clearly
#   below 2^-24 (here a weight of 1e-4) to flush to zero.
def underflow_setting():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 16, generator=g)
    y = x @ torch.randn(16, 64, generator=g)
    # tiny loss weight: the output gradients 2*err/(1024*64)*weight fall below fp16's 2^-24
    return dict(x=x, y=y, loss_weight=1e-3, lr=1e-2, steps=100)
