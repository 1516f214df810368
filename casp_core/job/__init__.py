"""A job, as the service and `casp prune` run it: `run.run_job` is its list of stages (load, evaluate dense, prune,
[recover,] save, export, evaluate, report); `stages` declares them once (name, progress weight, timers, when each
runs); `plan` checks the settings against the model's config once (the API, the command line and the job all call
it); `steps` holds the steps its kinds share (staging, the retry state, the checkpoint and exports, the report);
`sweep/` is a job with a target instead of a ratio.
"""
