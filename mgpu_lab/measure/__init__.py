"""Instruments that observe the algorithms from outside: memory accounting, activation memory,
collective traces, timing, bytes on the wire (:mod:`.wire`)."""
