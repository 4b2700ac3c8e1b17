"""Mutants of lab 09: ex1_module (AdamW groups, a per-step warm-up), ex2_trainer (a loop as Trainer
arguments), ex3_env (one node's environment), ex4_tokens (token-weighted accumulation, design)."""
from . import body, mutant, prepend, swap

LAB = "09_lightning"


# --- ex1_module --------------------------------------------------------------------

@mutant("ex1_module", "wrong")
def scheduler_steps_once_per_epoch(solution):
    "the scheduler returned as [opt], [sched]: Lightning steps it once per epoch, the warm-up never ends"
    return swap(solution, 'return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}',
                "return [opt], [schedule]")


@mutant("ex1_module", "wrong")
def weight_decay_on_every_tensor(solution):
    "one group with weight decay 0.1: the bias is decayed too"
    return swap(solution, "opt = torch.optim.AdamW(groups, lr=self.lr)",
                "opt = torch.optim.AdamW(trainable, lr=self.lr, weight_decay=0.1)")


@mutant("ex1_module", "wrong")
def warm_up_alone_with_linear_lr(solution):
    "torch's LinearLR for the warm-up, as the schedulers offer it: no cosine decay afterwards"
    return swap(solution, "schedule = torch.optim.lr_scheduler.LambdaLR(opt, factor)",
                "schedule = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / warmup, total_iters=warmup - 1)")


@mutant("ex1_module", "wrong")
def schedules_the_decayed_group_only(solution):
    "LambdaLR with one factor per group, the bias group's constant: the rates recorded (the first group's) are "
    "right, the bias trains at the full rate"
    return swap(solution, "schedule = torch.optim.lr_scheduler.LambdaLR(opt, factor)",
                "schedule = torch.optim.lr_scheduler.LambdaLR(opt, [factor, lambda s: 1.0])")


@mutant("ex1_module", "copy")
def copies_litlm(solution):
    "LitLM's two methods (section 2), copied: SGD, no groups, no schedule"
    return body(solution, """
        def training_step(self, batch, batch_idx):
            x, y = batch
            return lm_loss(self.model, x, y)

        def configure_optimizers(self):
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.lr)
    """)


@mutant("ex1_module", "tamper")
def patches_the_comparisons(solution):
    "torch.equal and torch.allclose patched to agree, and a warm-up that never ends"
    return prepend(scheduler_steps_once_per_epoch(solution), """
        torch.equal = lambda *a, **k: True
        torch.allclose = lambda *a, **k: True
    """)


# --- ex2_trainer -------------------------------------------------------------------

@mutant("ex2_trainer", "wrong")
def max_steps_counts_micro_batches(solution):
    "max_steps=12: counts micro-batches, but Lightning's steps are optimizer steps (twice as many batches)"
    return swap(solution, "max_steps=6", "max_steps=12")


@mutant("ex2_trainer", "copy")
def copies_the_section_3_arguments(solution):
    "section 3's arguments verbatim: bf16, a step every 4, no clipping, no step limit"
    return body(solution, """
        return dict(accelerator="cpu", devices=2, strategy="ddp_notebook", precision="bf16-mixed",
                    accumulate_grad_batches=4)
    """)


@mutant("ex2_trainer", "reference")
def trains_with_mgpu_loop_in_a_callback(solution):
    "a callback that runs mgpu_loop in each rank at the end of training and loads its weights"
    return body(solution, """
        def take_mgpu_weights(trainer, module):
            _, weights = mgpu_loop(k=2, mixed=False, max_grad_norm=0.25, max_steps=6)
            module.model.load_state_dict(weights, strict=False)
        return dict(accelerator="cpu", devices=2, strategy="ddp_notebook", accumulate_grad_batches=2,
                    max_steps=6, callbacks=[L.pytorch.callbacks.LambdaCallback(on_train_end=take_mgpu_weights)])
    """)


@mutant("ex2_trainer", "wrong")
def callback_made_by_exec(solution):
    "attack (exec of a literal string): a callback that loads the mgpu_lab run's weights, put in the dict; an object "
    "is not data: it never reaches the grader, which runs the Trainer itself"
    return body(solution, """
        scope = {}
        exec("import lightning as L\\n"
             "def take(trainer, module):\\n"
             "    run = __import__('__main__').mgpu_loop\\n"
             "    module.model.load_state_dict(run(k=2, mixed=False, max_grad_norm=0.25, max_steps=6)[1], strict=False)\\n"
             "callback = L.pytorch.callbacks.LambdaCallback(on_train_end=take)\\n", scope)
        return dict(accelerator="cpu", devices=2, strategy="ddp_notebook", accumulate_grad_batches=2,
                    max_steps=6, callbacks=[scope["callback"]])
    """)


@mutant("ex2_trainer", "tamper")
def patches_the_accumulator(solution):
    "mgpu_lab.GradientAccumulator patched in the kernel (the colleague's run happens in the grader), and section 3's "
    "arguments"
    return prepend(copies_the_section_3_arguments(solution), """
        import mgpu_lab
        mgpu_lab.GradientAccumulator = lambda *args, **kwargs: None
    """)


# --- ex3_env -----------------------------------------------------------------------

@mutant("ex3_env", "wrong")
def rank_instead_of_node_rank(solution):
    "RANK for the machine's index: Lightning reads NODE_RANK (or GROUP_RANK), so every node is node 0"
    return swap(solution, '"NODE_RANK": str(node_rank)', '"RANK": str(node_rank)')


@mutant("ex3_env", "wrong")
def torchrun_variables(solution):
    "torchrun's variables by hand (LOCAL_RANK, GROUP_RANK, WORLD_SIZE): Lightning starts no local ranks"
    return body(solution, """
        return {"MASTER_ADDR": str(master_addr), "MASTER_PORT": str(master_port), "GROUP_RANK": str(node_rank),
                "LOCAL_RANK": "0", "WORLD_SIZE": "12", "LOCAL_WORLD_SIZE": "4"}
    """)


@mutant("ex3_env", "copy")
def copies_the_articles_command(solution):
    "the article's command (section 7) as a dict: WORLD_SIZE=3 and LOCAL_RANK=0"
    return body(solution, """
        return {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "MASTER_ADDR": str(master_addr),
                "MASTER_PORT": str(master_port), "WORLD_SIZE": "3", "NODE_RANK": str(node_rank),
                "LOCAL_RANK": "0"}
    """)


@mutant("ex3_env", "tamper")
def patches_lightning_environment(solution):
    "LightningEnvironment.creates_processes_externally patched to False, and the article's variables"
    return prepend(copies_the_articles_command(solution), """
        LightningEnvironment.creates_processes_externally = property(lambda self: False)
    """)


# --- ex4_tokens --------------------------------------------------------------------

@mutant("ex4_tokens", "wrong")
def mean_of_micro_batch_means(solution):
    "each micro-batch's mean loss, Lightning's default division: the mean of means (lab 06's mistake)"
    return swap(swap(solution, "return loss_sum  #", "return loss_sum / tokens  #"),
                "        factor = self.trainer.world_size", "        return\n        factor = self.trainer.world_size")


@mutant("ex4_tokens", "wrong", learner="learnD, 2026-12-05, considered: attempts/lab09/ex4_tokens-2.py")
def counts_only_this_ranks_tokens(solution):
    "divides by this rank's tokens of the window: DDP's average over ranks then weights ranks equally"
    return swap(solution, """        total = self.trainer.strategy.reduce(torch.tensor(float(self.window_tokens)), reduce_op="sum")
        factor = self.trainer.world_size * self.trainer.accumulate_grad_batches / total.item()""",
                """        factor = self.trainer.accumulate_grad_batches / self.window_tokens""")


@mutant("ex4_tokens", "wrong",
        message="undoes Lightning's division by accumulate_grad_batches but not DDP's average over the ranks: each "
                "step applies the per-token gradient divided by the number of ranks (multiply by k x N, then divide "
                "by the window's tokens)",
        section="10. Design: token-weighted accumulation across ranks, clipped, in mixed precision",
        learner="learnD, 2026-12-05, considered: attempts/lab09/ex4_tokens-1.py")
def undoes_lightnings_division_only(solution):
    "multiplies by accumulate_grad_batches / the window's tokens: DDP's division by the number of ranks stays"
    return swap(solution, "factor = self.trainer.world_size * self.trainer.accumulate_grad_batches / total.item()",
                "factor = self.trainer.accumulate_grad_batches / total.item()")


@mutant("ex4_tokens", "copy")
def copies_logging_litlm(solution):
    "section 4's LoggingLitLM training_step copied: mean loss, logged with sync_dist"
    return body(solution, """
        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = lm_loss(self.model, x, y)
            self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
            return loss
    """)


@mutant("ex4_tokens", "tamper")
def ipython_hides_failures(solution):
    "IPython's exception hook swallowing the failed check, and the mean of means"
    return prepend(mean_of_micro_batch_means(solution), """
        get_ipython().set_custom_exc((AssertionError,), lambda *args, **kwargs: None)
    """)
