"""Reporting: tidy CSV summaries, then LaTeX tables and PNG figures with the papers' numbers beside ours.

Results flow one way, in two stages; no module does both:

1. ``summaries``: raw outputs of the other stages (perplexity, recall and lm-eval JSON, each
   model's ``metrics.csv``, DimPO fidelity CSVs) -> tidy CSVs (``results/summary``).
2. The renderers read only those CSVs and ``reference/`` (``paper``), and write LaTeX
   (``latex``) and PNG (``plots``), one module per paper:

   * ``dar``: seed 000 (DAR) Tables 1-4 and Figure 3;
   * ``baselines``: seed 001 (sliding-window, dilated and hybrid attention);
   * ``recall``: the multi-query associative recall probe (ours);
   * ``lm_eval``: the lm-evaluation-harness scores of every run;
   * ``dimpo``: seed 003 (DimPO) Table 1.

``selection`` says which runs each output shows, from the run fields alone; ``outputs`` is the
registry (output -> summaries, renderer, caption, category, and whether a config calls for it)
that ``rules/report.smk`` and the ``figures`` target follow.
"""
