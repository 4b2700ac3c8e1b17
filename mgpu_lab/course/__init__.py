"""The course machinery (the ``[course]`` extra), in four wings whose imports run one way:
``notebook/`` (the notebook model) under ``grading/`` (the engine: kernels, sandbox,
judges, scores), under ``classroom/`` (a class: hand-ins, reports, LMS, platforms) and
``authoring/`` (the author's commands: labs, tour, GPU pass). The library never imports it.

This package is also the pytest plugin loaded by ``-p mgpu_lab.course`` (below)."""

import sys as _sys

# Every course process reads notebooks with nbformat, which imports jsonschema, whose
# optional "iri" format checker imports rfc3987_syntax, which builds a grammar at import:
# 1.4 s of CPU in each process (each graded notebook's runner, the grader, the tour).
# Notebooks are validated against draft-4 schemas, which have no "iri" format, so the
# course's processes go without that checker (jsonschema skips it on ImportError).
# pytest processes (run.sh's, ``mgpu-lab labs check``'s, the GPU pass's) load this package
# first, ``-p mgpu_lab.course``, before nbval imports nbformat: 1.8 s of CPU less each.
_sys.modules.setdefault("rfc3987_syntax", None)
