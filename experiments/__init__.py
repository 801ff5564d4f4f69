"""Entry points, one per experiment: `python -m experiments.<name> --flag=...` (absl flags).

Each defines its flags only when run, so each imports as a library; shared flags and the result
writer live in experiments/common.py.
"""
