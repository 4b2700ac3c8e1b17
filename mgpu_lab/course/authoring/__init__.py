"""The lab author's commands, on the grading engine: ``mgpu-lab labs`` (build, execute,
copy, check), ``mgpu-lab tour`` and the GPU pass. It imports grading and notebook, never
the classroom."""
