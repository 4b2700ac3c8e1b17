"""A class, on the grading engine: hand-ins, the gradebook, reports and feedback, the LMS
(roster and identity, Canvas, nbgrader), and the Gradescope and PrairieLearn exports; the
``mgpu-lab grade`` and ``mgpu-lab export`` commands. It imports grading and notebook."""
