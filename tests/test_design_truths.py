"""The hidden judges of the design exercises of labs 11 and 12 compute their cases' costs from exact formulas
(the hidden cases are too large for the lab's own evaluator to run in the grader's time and memory). Here those
formulas, taken from the solution's graded cell as the grader runs it, equal the evaluator wherever it runs."""
import itertools

import nbformat
import pytest

from conftest import ROOT
from mgpu_lab.course.notebook.cells import nbgrader_meta


def _graded(lab, exercise):
    """The namespace of the lab's setup cells, the exercise's solution and its graded cell, run top to bottom
    (hidden parts included, as nbval runs them)."""
    nb = nbformat.read(ROOT / "solutions" / f"{lab}.ipynb", as_version=4)
    ns = {}
    for cell in nb.cells:
        if "setup" in cell.metadata.get("tags", []):
            exec(cell.source, ns)
    cells = {nbgrader_meta(c).get("grade_id"): c.source for c in nb.cells}
    exec(cells[exercise], ns)
    exec(cells[exercise + "_test"], ns)
    return ns


def test_lab12_choose_schedule_judges_with_the_replays_numbers():
    ns = _graded("12_pipeline_parallel", "choose_schedule")
    exact, replayed = ns["exact"], ns["replayed"]
    held_microbatches = ns["held_microbatches"]
    for p, m, name in itertools.product(range(1, 9), range(1, 41), replayed):
        try:
            replay, v = replayed[name](p, m)
        except ValueError:
            assert exact(name, p, m) is None, (name, p, m)
            continue
        held = max(held_microbatches([a[:-2] for a in rank]) for rank in replay)
        assert exact(name, p, m)[:2] == (held, v), (name, p, m)
        assert exact(name, p, m)[2] == pytest.approx(ns["bubble_of"](replay), abs=1e-12), (name, p, m)


def _measure_every_plan(ns, sizes):
    """run_plan of every plan at each of ``sizes`` on 2 ranks: ``[[(memory, sent) per plan] per size]``, rank 0's
    (the ranks agree)."""
    plans = [dict(zip(ns["CHOICES"], values)) for values in itertools.product(*ns["CHOICES"].values())]

    def every_plan():
        out = []
        for sc in sizes:
            torch = ns["torch"]
            torch.manual_seed(0)
            state = ns["TinyLM"](sc["vocab"], sc["hidden"], sc["ffn"]).state_dict()
            ids, target = (torch.randint(0, sc["vocab"], (sc["batch"], sc["seq"])) for _ in range(2))
            out.append([(r["memory"], r["sent"]) for r in (ns["run_plan"](c, sc, state, ids, target) for c in plans)])
        return out
    runs = ns["launch"](every_plan, nprocs=2, backend="gloo", timeout=300)
    assert runs[0] == runs[1]
    return plans, runs[0]


@pytest.mark.slow
def test_lab11_tp_plans_judges_with_run_plans_numbers():
    ns = _graded("11_tensor_parallel", "tp_plans")
    sizes = [dict(vocab=42, hidden=24, ffn=14, batch=3, seq=6), dict(vocab=130, hidden=40, ffn=54, batch=2, seq=22)]
    plans, measured = _measure_every_plan(ns, sizes)
    for sc, row in zip(sizes, measured):
        for plan, got in zip(plans, row):
            assert ns["exact"](plan, sc) == got, (sc, plan)


def test_lab11_tp_plans_scenarios_are_a_design_problem():
    """Every scenario (A, B and the hidden ones) has a plan within both budgets, no plan is within every scenario's,
    and in the hidden scenarios no plan's memory or traffic lies within 3 % of a budget (as the lab states)."""
    ns = _graded("11_tensor_parallel", "tp_plans")
    plans = [dict(zip(ns["CHOICES"], values)) for values in itertools.product(*ns["CHOICES"].values())]
    scenarios = list(ns["SCENARIOS"].values()) + ns["hidden_scenarios"]
    fits = []
    for sc in scenarios:
        costs = [ns["exact"](c, sc) for c in plans]
        fits.append({i for i, (memory, sent) in enumerate(costs) if memory <= sc["memory"] and sent <= sc["sent"]})
        assert fits[-1], sc
        if sc in ns["hidden_scenarios"]:
            margin = min(min(abs(m / sc["memory"] - 1), abs(s / sc["sent"] - 1)) for m, s in costs)
            assert margin >= 0.03, (sc, margin)
    assert not set.intersection(*fits), [plans[i] for i in set.intersection(*fits)]


def test_lab13_cost_models_judge_runs_the_plan_of_the_solutions_parallelize():
    """Lab 13's design (c) is judged by runs the hidden judge makes with its own copy of section 2's plan (the
    judge process has no `parallelize`: it is exercise (a)'s answer). The copy's plan and saved ops must be the
    solution's: change both together (and the stored worked example, `labs expects --misconceptions`)."""
    import ast
    nb = nbformat.read(ROOT / "solutions" / "13_capstone.ipynb", as_version=4)
    cells = {nbgrader_meta(c).get("grade_id"): c.source for c in nb.cells}

    def assigned(source, function):
        # the blocks' plan, the gather before each sub-block, the saved ops, and the plan outside the blocks (the
        # dict literals given to parallelize_module)
        fn = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == function)
        out = {t.id: ast.dump(n.value) for n in ast.walk(fn) if isinstance(n, ast.Assign)
               for t in n.targets if isinstance(t, ast.Name) and t.id in ("plan", "keep", "gather")}
        out["outside"] = [ast.dump(n.args[2]) for n in ast.walk(fn) if isinstance(n, ast.Call)
                          and getattr(n.func, "id", None) == "parallelize_module" and isinstance(n.args[2], ast.Dict)]
        out["units"] = [ast.dump(n) for n in ast.walk(fn) if isinstance(n, ast.Call)
                        and getattr(n.func, "id", None) == "fully_shard"]
        return out
    solution = assigned(cells["parallelize"], "parallelize")
    assert set(solution) == {"plan", "keep", "gather", "outside", "units"} and solution["outside"]
    assert assigned(cells["cost_model_test"], "_reference_parallelize") == solution
