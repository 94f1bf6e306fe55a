"""Offline analysis of step logs, apart from the code that runs beside decoding.

- `steps`: JSON step logs -> per-configuration tables and how complete the log is
- `replay`: what other budgets and top-k would have accepted, from logged trees
- `digest`: a log folded into what `advise` and `report` need
- `advise`: the best configuration, with the step-time cost curve
- `report`: an HTML report with plots
- `trace_events`: a log as Chrome trace events
"""
