# origin: considered alternative
# what I believed: the linear layers' outputs are what costs FLOPs to recompute; recomputing both attention bmms is cheap enough (about 8 % of a step here), so keeping addmm alone fits both bounds.
# visible check said: b=2, s=64, h=32, heads=4: kept alive 23% of the plain forward's; step FLOPs 1.083x the plain step's / ex5 passed
# grader said: 0/4 WrongCases: `plans` does not hold the cases the check asked for: a list with fewer items than the solution's result there (what your code returned for a case, or the cases themselves)
# misconception: recomputing both attention bmms (q@k^T and probs@v) costs 4bs^2h FLOPs per layer forward, a share that grows with s/h: about 8 % of a step here but over 10 % on the hidden configuration; only the s x s scores product may be dropped, the (s, h/heads) product must be kept. (Graded in substance as attempt ex5_budget-2.py, padded past the grader's structure check.)
def budget_plan(s, h, heads):
    # YOUR CODE HERE
    # keep the linear layers' outputs only; recompute attention (both bmm: cheap-ish) and everything elementwise
    return [("addmm", None)]
