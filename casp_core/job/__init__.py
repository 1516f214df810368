"""A job, as the service and `casp prune` run it: `run.run_job` is its list of stages (load, evaluate dense, prune,
[recover,] save, export, evaluate, report), `steps` the steps its kinds share (staging, the retry state, the
checkpoint and exports, the report); `sweep/` is a job with a target instead of a ratio.
"""
