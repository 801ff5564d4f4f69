"""Reading results and drawing figures: nothing here computes with the model.

`analysis.results` is the results schema (every result's "schema" field and what it holds);
`analysis.figures` draws every figure from a results directory (`python -m analysis.figures`);
`analysis.rope_float` measures the floating-point behaviour of RoPE itself (run by
`python -m experiments.rope_float`); `analysis.profile` joins a profile's per-thunk trace events
to the optimized HLO (run by `python -m experiments.profile`).
"""
