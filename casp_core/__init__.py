"""casp_core: Correlation-Aware Structured Pruning, as a library.

The method's stages, one module each, in the paper's order: calibration (windows, layer inputs, statistics),
interaction (Q), allocation (r_l; `temperature` chooses alpha "auto"), budget (heads and channels per layer),
solvers (`selection` applies them to one layer), compensation, surgery, verification; `prune` runs them over the
layers and returns a `results.PruneResult`; `recovery` optionally fine-tunes LoRA adapters on the pruned model and
merges them; `job.run_job` is the whole job (load, evaluate, prune, [recover,] save, report) with `job.STAGES` its
stages. Beside the method: `model` (loading and the supported families), `data` (texts), `checkpoint`, `run`
(progress, cancellation, timing), and the subpackages `eval/`, `report/` and `cli/`.
"""
