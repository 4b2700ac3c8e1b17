"""The course machinery (the ``[course]`` extra): build labs from solutions,
run notebooks in kernels, grade them, tour them. The library never imports it."""
