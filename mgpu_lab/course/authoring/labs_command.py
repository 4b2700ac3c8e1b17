"""``mgpu-lab labs``: the commands of a lab's author and of a learner.

    mgpu-lab labs build [--check] [SOLUTION ...]   labs/ generated from solutions/
    mgpu-lab labs execute [NOTEBOOK ...]           run solutions in place, store outputs
    mgpu-lab labs expects [NOTEBOOK ...] [--misconceptions]
                                                   store the cases each check asks for (after
                                                   a probe or its inputs change); and the
                                                   fingerprints of the lab's misconceptions
    mgpu-lab labs copy DIR [--labs NN ...] [--update]  the labs, to work in (no clone needed);
                                                   --update: a changed lab replaces an older copy
    mgpu-lab labs check NN [--portable]            one lab, as CI checks it (the author's loop)
    mgpu-lab labs check --portable                 every solution's nbval under baseline instruction sets

They work on the checkout they are run in: ``labs/`` and ``solutions/`` are found by
walking up from the current folder (or ``--root``; :mod:`~mgpu_lab.course.notebook.layout`).
The notebooks' machinery is :mod:`~mgpu_lab.course.notebook.notebooks`; ``labs execute`` runs
them in the grader's kernels (:mod:`~mgpu_lab.course.grading.kernel`).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Iterable, List

import nbformat

from ..notebook.layout import backup_name, copy_labs, course_dir, find_root
from ..notebook.notebooks import MarkerError, build_labs, clean_outputs


def _cmd_build(args) -> int:
    try:
        args.solutions, args.labs = course_dir(args, "solutions"), course_dir(args, "labs")
        stale = build_labs(args.solutions, args.labs, check=args.check, only=args.notebooks)
    except (MarkerError, FileNotFoundError) as err:
        for item in getattr(err, "stale", []):
            print(f"{'stale' if args.check else 'written'}: {item}")
        print(f"mgpu-lab labs build: refused, the other labs are "
              f"{'checked' if args.check else 'built'}:\n{err}", file=sys.stderr)
        return 2
    for item in stale:
        print(f"{'stale' if args.check else 'written'}: {item}")
    if args.check and stale:
        print("labs/ is out of date: run `mgpu-lab labs build`", file=sys.stderr)
        return 1
    if not stale:
        print(f"labs up to date ({args.labs})")
    return 0


def execute_notebook(path: Path, timeout: float = 600.0) -> List[str]:
    """Run a solution in place (cwd = its folder), store outputs; list failures."""
    from ..grading.kernel import run_notebook  # the grader's kernels and time limits

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    results = run_notebook(nb, cwd=path.parent, timeout=timeout, desc=path.name)
    failures = [f"{path.name} cell {r.index}: {r.error}: {r.message}"
                for r in results if r.error and not r.expected_error]
    clean_outputs(nb)
    nbformat.write(nb, path)
    return failures


def _cmd_execute(args) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as in CI: same numbers
    if not args.notebooks:
        try:
            args.solutions = course_dir(args, "solutions")
        except FileNotFoundError as err:
            print(f"mgpu-lab labs execute: {err}", file=sys.stderr)
            return 2
    paths: Iterable[Path] = args.notebooks or sorted(Path(args.solutions).glob("*.ipynb"))
    failures = []
    for path in paths:
        if not Path(path).is_file():
            print(f"mgpu-lab labs execute: no such notebook {path}", file=sys.stderr)
            return 2
        failed = execute_notebook(Path(path), timeout=args.timeout)
        note = f", {len(failed)} cell(s) failed" if failed else ""
        print(f"{path}: executed, outputs stored{note}")
        failures += failed
    for line in failures:
        print(f"FAILED {line}", file=sys.stderr)
    return 1 if failures else 0


def solution_answers(path: Path, timeout: float = 600.0) -> dict:
    """``{grade_id: {name: value}}``: what each graded cell's probe sends back when the
    solution is graded by the real grader (its own cells as the submission, no cases
    checked); RuntimeError naming each check the solution does not pass."""
    from ..grading.judge import load_answer
    from ..grading.sandbox import Limits, probe
    from ..grading.session import run_prepared
    from ..grading.submission import prepare_submission
    from ..notebook.cells import graded_cells
    nb = nbformat.read(path, as_version=4)
    for cell in graded_cells(nb).values():              # stale ones must not fail it
        cell.metadata.get("mgpu_lab", {}).pop("expects", None)
    captured: dict = {}
    prepared = prepare_submission(nb, nb)
    run = run_prepared(prepared, nb, probe(), Limits(), timeout, None, capture=captured)
    failed = [f"{gid}: {v.error if v else 'NotRun'}: {v.message[:300] if v else ''}"
              for i, gid in prepared.graded.items() for v in [run.verdicts.get(i)]
              if v is None or v.error]
    if failed:
        raise RuntimeError(f"{path.name}: the solution fails its own checks:\n  " + "\n  ".join(failed))
    answers = {}
    for gid, msg in captured.items():
        answers[gid] = {}
        for name, data in msg.names.items():
            try:                        # what the judge cannot read, it does not get either
                answers[gid][name] = load_answer(data)
            except Exception:
                pass
    return answers


def write_expects(path: Path, timeout: float = 600.0, answers: dict = None) -> List[str]:
    """Store each graded cell's ``expects`` (:mod:`~mgpu_lab.course.grading.cases`) in the
    solution at ``path``, from ``answers`` (default: :func:`solution_answers`); the grade ids
    whose expects changed."""
    from ..grading.cases import names_read, render, signature
    from ..notebook import graded_cell
    from ..notebook.cells import graded_cells
    answers = solution_answers(path, timeout) if answers is None else answers
    nb = nbformat.read(path, as_version=4)
    changed = []
    for gid, cell in graded_cells(nb).items():
        read = names_read(graded_cell.split(cell.source).judge)
        expects = {name: render(signature(value)) for name, value in answers[gid].items()
                   if name in read}
        meta = cell.metadata.setdefault("mgpu_lab", {})
        if meta.get("expects") != expects:
            meta["expects"] = expects
            changed.append(gid)
    if changed:
        nbformat.write(nb, path)
    return changed


def exercise_sections(nb) -> dict:
    """``{exercise grade_id: the title of the lab's section (a level-1 or 2 heading) above
    its cell}``: where a misconception of that exercise is explained, by default."""
    from ..notebook.cells import nbgrader_meta
    from ..notebook.exercises import HEADING
    out, section = {}, ""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                m = HEADING.match(line)
                if m and len(line.lstrip()) - len(line.lstrip().lstrip("#")) <= 2:
                    section = m.group(1)
        meta = nbgrader_meta(cell)
        if meta.get("solution") and meta.get("grade_id"):
            out[meta["grade_id"]] = section
    return out


def lab_mutants(path: Path) -> list:
    """The misconceptions of the lab at ``path`` (``tests/mutants``' wrong answers of the
    checkout the solution lies in: :attr:`Mutant.misconception`)."""
    import importlib
    tests = Path(path).resolve().parent.parent / "tests"
    if not (tests / "mutants" / "__init__.py").is_file():
        raise FileNotFoundError(f"no {tests / 'mutants'}: misconceptions are written from "
                                "a course checkout")
    if str(tests) not in sys.path:
        sys.path.insert(0, str(tests))
    mutants = importlib.import_module("mutants")
    return [m for m in mutants.all_mutants() if m.lab == Path(path).stem and m.misconception]


def _graded_run(instructor, submission, timeout: float, pool=None):
    """``(answers {grade_id: {name: value}}, verdicts {grade_id: Verdict or None})`` of
    ``submission`` graded against ``instructor`` by the real grader (no static pass)."""
    from ..grading.judge import load_answer
    from ..grading.sandbox import Limits, probe
    from ..grading.session import run_prepared
    from ..grading.submission import prepare_submission
    captured: dict = {}
    prepared = prepare_submission(submission, instructor)
    run = run_prepared(prepared, instructor, probe(), Limits(), timeout, None, pool=pool,
                       capture=captured)
    answers = {}
    for gid, msg in captured.items():
        answers[gid] = {}
        for name, data in msg.names.items():
            try:
                answers[gid][name] = load_answer(data)
            except Exception:
                pass
    return answers, {gid: run.verdicts.get(i) for i, gid in prepared.graded.items()}


def write_misconceptions(path: Path, timeout: float = 600.0, log=print) -> List[str]:
    """Store in each graded cell of the solution at ``path`` its exercise's known
    misconceptions (:mod:`~mgpu_lab.course.grading.misconceptions`): every wrong mutant of
    the lab (:func:`lab_mutants`) graded twice by the real grader, the notebook cut after its
    exercise's last graded cell; a fingerprint stored for each graded cell of its exercise
    that it fails, unless its results are the solution's or an earlier misconception's
    (within the tolerance), differ from one grading to the next, or did not come back; with
    which part of the check caught it (``caught``: "visible" or "hidden"). Also the
    solution's own fingerprint (``reference``: what an answer that matches none is compared
    with). The grade ids whose misconceptions or reference changed."""
    import copy
    from ..grading.cases import cases_of
    from ..grading.judge_pool import JudgePool
    from ..grading.cases import REFERENCE
    from ..grading.misconceptions import META, closest, distance, fingerprint, reference
    from ..grading.sandbox import Limits
    from ..grading.session import JUDGE_TIMEOUT, judge_environment
    from ..notebook.cells import exercise_of, graded_cells, nbgrader_meta
    nb = nbformat.read(path, as_version=4)
    clean = copy.deepcopy(nb)
    for cell in graded_cells(clean).values():
        cell.metadata.get("mgpu_lab", {}).pop(META, None)
        cell.metadata.get("mgpu_lab", {}).pop(REFERENCE, None)
    tests, exercise, sections = graded_cells(clean), exercise_of(clean), exercise_sections(clean)
    cases = {gid: cases_of(cell) for gid, cell in tests.items()}

    def prints(gid, answer):
        return fingerprint(answer, cases[gid].get("expects", answer), cases[gid].get("free", ()))

    pool = JudgePool(lambda home: judge_environment(home, Limits().memory_gib),
                     max(timeout, JUDGE_TIMEOUT))
    found: dict = {gid: [] for gid in tests}
    try:
        answers, verdicts = _graded_run(clean, clean, timeout, pool)
        failed = [g for g, v in verdicts.items() if v is None or v.error]
        if failed:
            raise RuntimeError(f"{path.name}: the solution fails its own checks: {failed}")
        right = {gid: prints(gid, a) for gid, a in answers.items()}
        refs = {gid: reference(a, cases[gid].get("expects", a), cases[gid].get("free", ()),
                               cases[gid].get("veiled", ())) for gid, a in answers.items()}
        for m in lab_mutants(path):
            mine = [g for g, ex in exercise.items() if ex == m.exercise]
            last = max(i for i, c in enumerate(clean.cells) if nbgrader_meta(c).get("grade_id") in mine)
            cut = copy.deepcopy(clean)
            cut.cells = cut.cells[:last + 1]
            submission = copy.deepcopy(cut)
            cell = next(c for c in submission.cells if nbgrader_meta(c).get("solution")
                        and nbgrader_meta(c).get("grade_id") == m.exercise)
            cell.source = m.make(cell.source)
            got, said = _graded_run(cut, submission, timeout, pool)
            again, _ = _graded_run(cut, submission, timeout, pool)   # the same results twice?
            for gid in mine:
                v = said.get(gid)
                if v is None or not v.error:
                    log(f"  {m.name} ({gid}): {'passes' if v else 'not judged'}: not stored")
                    continue
                if gid not in got:
                    log(f"  {m.name} ({gid}): its probe sent nothing back ({v.error}): not stored")
                    continue
                fp = prints(gid, got[gid])
                if gid not in again or distance(fp, prints(gid, again[gid])) > 1.0:
                    log(f"  {m.name} ({gid}): other results when graded again: not stored")
                    continue
                if distance(fp, right[gid]) <= 1.0:
                    log(f"  {m.name} ({gid}): the solution's results ({v.error}): not stored")
                    continue
                same = closest(fp, found[gid])
                if same is not None:          # the feedback could not tell them apart
                    log(f"  {m.name} ({gid}): the results of {same[0]}: not stored")
                    continue
                found[gid].append({"id": m.name, "message": m.message or m.mistake,
                                   "section": m.section or sections.get(m.exercise, ""),
                                   "caught": v.where or "hidden", "fingerprint": fp})
                log(f"  {m.name} ({gid}): stored ({v.error}, {len(str(fp))} characters)")
    finally:
        pool.close()
    changed = []
    for gid, cell in graded_cells(nb).items():
        meta = cell.metadata.setdefault("mgpu_lab", {})
        if meta.get(META, []) != found[gid] or meta.get(REFERENCE) != refs.get(gid):
            changed.append(gid)
        if gid in refs and "expects" in cases[gid]:
            meta[REFERENCE] = refs[gid]
        if found[gid]:
            meta[META] = found[gid]
        else:
            meta.pop(META, None)
    if changed:
        nbformat.write(nb, path)
    return changed


def _cmd_expects(args) -> int:
    if not args.notebooks:
        try:
            args.solutions = course_dir(args, "solutions")
        except FileNotFoundError as err:
            print(f"mgpu-lab labs expects: {err}", file=sys.stderr)
            return 2
    paths = args.notebooks or sorted(Path(args.solutions).glob("*.ipynb"))
    code = 0
    for path in map(Path, paths):
        try:
            changed = write_expects(path, args.timeout)
        except RuntimeError as err:
            print(f"mgpu-lab labs expects: {err}", file=sys.stderr)
            code = 1
            continue
        print(f"{path}: expects {'written for ' + ', '.join(changed) if changed else 'up to date'}")
        if args.misconceptions:
            try:
                changed = write_misconceptions(path, args.timeout)
            except (RuntimeError, FileNotFoundError) as err:
                print(f"mgpu-lab labs expects: {err}", file=sys.stderr)
                code = 1
                continue
            print(f"{path}: misconceptions "
                  f"{'written for ' + ', '.join(changed) if changed else 'up to date'}")
    return code


def _cmd_copy(args) -> int:
    try:
        done = copy_labs(args.dest, Path(args.root) / "labs" if args.root else None,
                         args.labs or (), update=args.update)
    except (FileNotFoundError, NotADirectoryError, FileExistsError) as err:
        print(f"mgpu-lab labs copy: {err}", file=sys.stderr)
        return 2
    for name in done.kept:
        print(f"kept {args.dest / name}: your work on this version of the lab (never overwritten)")
    for name, (theirs, release) in done.older.items():
        print(f"kept {args.dest / name}: made from an older version of the lab ({theirs or 'none'}"
              f" -> {release}); `mgpu-lab labs copy {args.dest} --labs {name.split('_')[0]} "
              f"--update` replaces it and keeps yours as {backup_name(args.dest / name).name}")
    for name, backup in done.replaced.items():
        print(f"replaced {args.dest / name} by this release's version; yours is {backup}")
    print(f"copied {len(done.copied)} lab(s) to {args.dest}"
          + (f": {', '.join(done.copied)}" if done.copied and len(done.copied) < 6 else "")
          + (f"; replaced {len(done.replaced)}" if done.replaced else "")
          + (f"; {len(done.same)} already this release" if done.same else "")
          + f"; open them with `jupyter lab {args.dest}`")
    return 0


def check_command(root: Path, lab: str) -> list:
    """The pytest command that checks one lab in the checkout ``root``: its nbval, and the
    mutation run of its mutants and its untouched cells (0 points), with its whole solution
    (full marks) graded too (``MGPU_LAB_MUTANTS_SOLUTION=1``), beside each other."""
    return [sys.executable, "-m", "pytest", "-p", "mgpu_lab.course", f"solutions/{lab}.ipynb", "tests/test_mutants.py",
            "--nbval", "--nbval-current-env", "--nbval-cell-timeout=300",
            "--nbval-sanitize-with", "solutions/sanitize.cfg", "-k", f"{lab} or three_mutants",
            "-p", "no:cacheprovider", "-q"]


README_TABLE_TEST = "tests/test_notebooks.py::test_readme_lab_table_matches_the_notebooks"


def readme_table_command(root: Path) -> list:
    """The pytest command of CI's check of README's lab table (each lab's exercises and
    points), in the checkout ``root``."""
    return [sys.executable, "-m", "pytest", README_TABLE_TEST, "-p", "no:cacheprovider", "-q"]


# torch's, oneDNN's and MKL's kernels limited to baseline instruction sets: other float kernels
# (other summation orders, other roundings), as another CPU would pick. A stored output that
# changes under them is not deterministic on any CPU (docs/AUTHORING.md).
PORTABLE_ENV = {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}


def portable_command(notebooks: list) -> list:
    """The nbval run of ``notebooks`` (paths relative to the checkout) that ``--portable`` adds,
    to be run with :data:`PORTABLE_ENV`: CI's options, two workers for more than one notebook."""
    workers = ["-n", "2", "--dist", "loadfile"] if len(notebooks) > 1 else []
    return [sys.executable, "-m", "pytest", "-p", "mgpu_lab.course", *workers, *notebooks,
            "--nbval", "--nbval-current-env", "--nbval-cell-timeout=300",
            "--nbval-sanitize-with", "solutions/sanitize.cfg", "-p", "no:cacheprovider", "-q"]


def _run_portable(root: Path, notebooks: list) -> int:
    from time import monotonic
    import subprocess
    start = monotonic()
    env = dict(os.environ, **PORTABLE_ENV)
    env.setdefault("OMP_NUM_THREADS", "1")
    code = subprocess.call(portable_command(notebooks), cwd=root, env=env)
    print(f"mgpu-lab labs check --portable ({' '.join(f'{k}={v}' for k, v in PORTABLE_ENV.items())}): "
          f"{'passed' if code == 0 else 'FAILED'} in {monotonic() - start:.0f} s")
    return code


def _cmd_check(args) -> int:
    """``labs build --check`` for the lab, README's lab table (:func:`readme_table_command`),
    then :func:`check_command`; its exit status. With ``--portable``, then the lab's nbval once
    more under :data:`PORTABLE_ENV` (no lab: every solution's, and nothing else)."""
    import subprocess
    from time import monotonic
    try:
        root = Path(args.root) if args.root else find_root()
    except FileNotFoundError as err:
        print(f"mgpu-lab labs check: {err}", file=sys.stderr)
        return 2
    if args.lab is None:
        if not args.portable:
            print("mgpu-lab labs check: name a lab (NN), or give --portable for every solution", file=sys.stderr)
            return 2
        return _run_portable(root, [p.relative_to(root).as_posix()
                                    for p in sorted((root / "solutions").glob("*.ipynb"))])
    found = [p for p in sorted((root / "solutions").glob("*.ipynb"))
             if p.stem == args.lab or p.name.split("_")[0] == args.lab]
    if len(found) != 1 or not (root / "tests" / "test_mutants.py").is_file():
        print(f"mgpu-lab labs check: no single solution {args.lab!r} in {root / 'solutions'} "
              "(or no tests/test_mutants.py: it runs CI's tests, which are in the course "
              "checkout, not in the package)", file=sys.stderr)
        return 2
    lab, start = found[0].stem, monotonic()
    try:
        stale = build_labs(root / "solutions", root / "labs", check=True, only=[found[0].name])
    except MarkerError as err:
        print(f"mgpu-lab labs check: labs build refuses it:\n{err}", file=sys.stderr)
        return 2
    if stale:
        print(f"mgpu-lab labs check: labs/{lab}.ipynb is stale: run `mgpu-lab labs build` "
              f"({', '.join(stale)})", file=sys.stderr)
        return 1
    env = dict(os.environ, MGPU_LAB_MUTANTS_SOLUTION="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    if (root / README_TABLE_TEST.split("::")[0]).is_file():
        table = subprocess.run(readme_table_command(root), cwd=root, env=env,
                               capture_output=True, text=True)
        if table.returncode != 0:
            said = [line for line in table.stdout.splitlines() if "README says" in line]
            print(f"mgpu-lab labs check: README.md's lab table is stale (CI's "
                  f"{README_TABLE_TEST} fails): each lab's row says `| NN | ... | exercises "
                  f"(points) |`:\n" + ("\n".join(said) or table.stdout[-3000:]), file=sys.stderr)
            return 1
    else:
        print(f"mgpu-lab labs check: README's lab table not checked: no "
              f"{README_TABLE_TEST.split('::')[0]} in {root}", file=sys.stderr)
    code = subprocess.call(check_command(root, lab), cwd=root, env=env)
    print(f"mgpu-lab labs check {lab}: {'passed' if code == 0 else 'FAILED'} "
          f"in {monotonic() - start:.0f} s")
    if code == 0 and args.portable:
        code = _run_portable(root, [f"solutions/{lab}.ipynb"])
    return code


def add_parser(subparsers) -> None:
    labs = subparsers.add_parser("labs", help="build, execute, copy or check the labs",
                                 description="build labs/ from solutions/, run them, copy them")
    sub = labs.add_subparsers(dest="labs_command", metavar="ACTION")
    sub.required = True
    build = sub.add_parser("build", help="generate labs/ from solutions/")
    build.add_argument("notebooks", nargs="*", metavar="SOLUTION",
                       help="only these solution notebooks (default: all)")
    build.add_argument("--check", action="store_true",
                       help="write nothing; exit 1 when labs/ is stale")
    build.add_argument("--root", type=Path, help="the course checkout (default: found from cwd)")
    build.add_argument("--solutions", type=Path, help="default: ROOT/solutions")
    build.add_argument("--labs", type=Path, help="default: ROOT/labs")
    build.set_defaults(func=_cmd_build)
    execute = sub.add_parser("execute", help="run solution notebooks in place and store outputs")
    execute.add_argument("notebooks", nargs="*", type=Path,
                         help="default: every notebook in --solutions")
    execute.add_argument("--root", type=Path, help="the course checkout (default: found from cwd)")
    execute.add_argument("--solutions", type=Path, help="default: ROOT/solutions")
    execute.add_argument("--timeout", type=float, default=600.0, help="seconds per cell")
    execute.set_defaults(func=_cmd_execute)
    expects = sub.add_parser("expects", help="store in each solution's graded cells the cases "
                             "their probes send back (the judge checks answers against them)")
    expects.add_argument("notebooks", nargs="*", type=Path,
                         help="default: every notebook in --solutions")
    expects.add_argument("--root", type=Path, help="the course checkout (default: found from cwd)")
    expects.add_argument("--solutions", type=Path, help="default: ROOT/solutions")
    expects.add_argument("--timeout", type=float, default=600.0, help="seconds per cell")
    expects.add_argument("--misconceptions", action="store_true",
                         help="then grade each wrong mutant of the lab (tests/mutants) and store "
                              "the fingerprint of its results, which the feedback names")
    expects.set_defaults(func=_cmd_expects)
    copy_ = sub.add_parser("copy", help="copy the lab notebooks into a folder, to work in "
                           "(adds labs it lacks; --update replaces older versions, keeping "
                           "yours as NAME.ipynb.bak)")
    copy_.add_argument("dest", type=Path, metavar="DIR")
    copy_.add_argument("--labs", nargs="+", metavar="NN",
                       help="only these labs (number, id or file name; default: all)")
    copy_.add_argument("--root", type=Path, help="take ROOT/labs (default: this checkout's, "
                       "else the labs installed with the package)")
    copy_.add_argument("--update", action="store_true",
                       help="replace a copy made from an older version of a lab (a changed "
                            "lab) by this one; the old file is kept as NAME.ipynb.bak")
    copy_.set_defaults(func=_cmd_copy)
    check = sub.add_parser("check", help="one lab as CI checks it: labs/ fresh, README's lab "
                           "table, nbval, its solution (full marks), its untouched cells (0) "
                           "and its mutants")
    check.add_argument("lab", metavar="NN", nargs="?", help="the lab's number (00) or name (00_setup)")
    check.add_argument("--portable", action="store_true",
                       help="then its nbval once more with torch's, oneDNN's and MKL's kernels limited to "
                            "baseline instruction sets (no NN: every solution's nbval, and only that)")
    check.add_argument("--root", type=Path, help="the course checkout (default: found from cwd)")
    check.set_defaults(func=_cmd_check)

