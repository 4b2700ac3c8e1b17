"""The notebook model, at the bottom of the course: cells and their metadata, exercises,
graded cells (inputs, probe, judge), labs made from solutions, and where the checkout's
labs and solutions live. It imports nothing else of the course."""
