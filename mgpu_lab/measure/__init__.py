"""Instruments that observe the algorithms from outside: memory accounting, timing."""
