"""What the notebooks call: pipeline steps, figures, the results table, the paper's numbers, the runner.

* :mod:`.pipeline` — environment check, train a cell, evaluate every run, collect the table;
* :mod:`.plots` — every figure, drawn only from run files;
* :mod:`.notebook` — what a training notebook shows inline: its run's learning curve and one sampled round;
* :mod:`.results` — the results table, seeds aggregated with intervals;
* :mod:`.paper` — the paper's numbers, for comparison;
* :mod:`.reproduce` — the papermill runner (``python -m agonlib reproduce``);
* :mod:`.paths` — where a reproduction writes.
"""
