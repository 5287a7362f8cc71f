"""Multi-seed studies of gjax's algorithms (issue 21): `run` trains and evaluates the runs of a
study in parallel worker processes, `aggregate` turns their metrics into tables and figures.
See experiments/README.md."""
