"""The grading engine, on the notebook model: kernels, the sandbox and its runner, the
judges and their pools, the guard and tamper checks, scoring, and grading one notebook.
It imports only the notebook wing."""
