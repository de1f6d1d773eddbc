"""`infinity tune`: short trials of the user's model and config on this machine, one setting at a time.

- `knobs`: the searched settings (prefetch bucket, offload buffer counts, aio queue depth, block size,
  threads) and their ladders of values; `effects`: only the values that change the budget plan.
- `trial`: one trial, a short timed training run in a worker process (median step after a warm-up).
- `search`: coordinate descent over the knobs, with noise-aware comparisons and back-to-back confirmation.
- `auto_prefetch`: the "auto" prefetch bucket from a profiled trial (read time vs compute time per block).
- `tuner`: one session (trial configs, the profiled trial, the search); `report`: the table.
"""
