"""The GPU pass's steps, tried on CPU with a toy notebook, a toy benchmark and a toy test."""
import json

import nbformat
import pytest

from mgpu_lab.course.authoring import gpu_pass


def test_last_json_line_skips_other_lines():
    assert gpu_pass.last_json_line('table\n{"a": 1}\n{"b": 2}\nbye\n') == {"b": 2}
    assert gpu_pass.last_json_line("{not json\nno json here") is None


def test_first_cell_runs_before_the_lab_and_the_lab_is_unchanged(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1")])
    out = gpu_pass.with_first_cell(nb, "import torch")
    assert [c.source for c in out.cells] == ["import torch", "x = 1"]
    assert [c.source for c in nb.cells] == ["x = 1"]


def _toys(tmp_path, lab_ok=True, bench_ok=True):
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("assert FIRST == 'ran', 'the first cell did not run first'"),
        nbformat.v4.new_code_cell("y = 2" if lab_ok else "raise ValueError('broken lab')")])
    nb.metadata.kernelspec = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, tmp_path / "00_toy.ipynb")
    (tmp_path / "bench_toy.py").write_text("import json, sys\nprint('a table')\n"
                                           f"print(json.dumps({{'ratio': 1.5}}))\nsys.exit({0 if bench_ok else 3})\n")
    (tmp_path / "test_toy.py").write_text("import pytest\n@pytest.mark.gpu\ndef test_g():\n    pass\n")
    return [tmp_path / "00_toy.ipynb"], [tmp_path / "bench_toy.py"], ["-m", "gpu", str(tmp_path / "test_toy.py")]


@pytest.mark.parametrize("lab_ok, bench_ok", [(True, True), (False, True), (True, False)])
def test_one_results_file_with_tests_labs_and_benchmarks(tmp_path, lab_ok, bench_ok):
    notebooks, benchmarks, pytest_args = _toys(tmp_path, lab_ok, bench_ok)
    out = tmp_path / "results.json"
    gpu_pass.gpu_pass(out, root=tmp_path, notebooks=notebooks, benchmarks=benchmarks, pytest_args=pytest_args,
                      first_cell="FIRST = 'ran'", timeout=120, jobs=2 if lab_ok and bench_ok else 1)  # both ways
    results = json.loads(out.read_text())
    assert {"device", "date", "torch", "pytest", "labs", "benchmarks", "ok"} <= set(results)
    assert results["pytest"]["ok"], results["pytest"]["tail"]
    assert results["labs"][0]["ok"] == lab_ok, results["labs"][0]
    if not lab_ok:
        assert "cell 1: ValueError" in results["labs"][0]["failure"]
    assert results["benchmarks"][0]["ok"] == bench_ok
    assert results["benchmarks"][0]["summary"] == {"ratio": 1.5}
    assert results["ok"] == (lab_ok and bench_ok)


def test_refuses_without_a_gpu_unless_allowed(capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert gpu_pass.main(["--out", "/dev/null"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_the_text_of_cells_that_ask_about_cuda_is_kept(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("import torch\nprint('a figure:', torch.cuda.is_available())"),
        nbformat.v4.new_code_cell("print('not a GPU cell')")])
    nb.metadata.kernelspec = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, tmp_path / "00_toy.ipynb")
    result = gpu_pass.run_lab(tmp_path / "00_toy.ipynb", first_cell="import torch", timeout=120)
    assert result["ok"] and result["gpu_cells"] == [{"cell": 0, "text": f"a figure: {torch_cuda()}\n"}]


def torch_cuda():
    import torch
    return torch.cuda.is_available()


def test_a_budget_spent_runs_nothing_more_and_says_so(tmp_path):
    notebooks, benchmarks, pytest_args = _toys(tmp_path)
    out = tmp_path / "results.json"
    gpu_pass.gpu_pass(out, root=tmp_path, notebooks=notebooks, benchmarks=benchmarks, pytest_args=pytest_args,
                      first_cell="FIRST = 'ran'", timeout=120, budget=0)
    results = json.loads(out.read_text())
    assert sorted(results["not_run"]) == ["00_toy", "bench_toy.py", "pytest"]
    assert results["labs"] == results["benchmarks"] == [] and not results["ok"]
