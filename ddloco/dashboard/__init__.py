"""``ddloco dashboard`` and ``ddloco up --dashboard``: the run's live web page (the merge itself:
quorum, grace, contributors and their weights, staleness, alignment; membership; fragments;
learners) and the operator's actions. ``collect`` reads Redis, ``server`` serves the page,
``actions`` carries out what an operator asks, ``cli`` is the command."""
