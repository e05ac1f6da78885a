"""The shared core, which every other part may import and which imports none of them.

- `errors`: the exception types a command turns into one sentence and an exit code;
- `output`: atomic outputs (stage, then rename) for checkpoints, plans, reports and libraries;
- `jsonfile`: JSON files read with the path in every error;
- `stats`: the routing-statistics file that `trace`/`collect` write and `select`/`fidelity` read;
- `optional`: optional dependencies, named with the extra that installs them;
- `units`: one convention for sizes (binary prefixes).
"""
