"""Shared pytest settings.

tests/data holds fixture notebooks for the grader and the tour; they are inputs,
not notebooks to validate, so nbval (``--nbval``) must not collect them.
"""
collect_ignore = ["data"]
