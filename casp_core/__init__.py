"""casp_core: Correlation-Aware Structured Pruning, as a library. Its rooms, one folder each (docs/architecture.md):

- `method/`: the paper's loop in its order (calibration, interaction, allocation, temperature, budget, selection with
  the solvers, compensation, surgery, verification; `prune` runs them over the layers). It writes no files and
  knows no job.
- `families/`: one module per model family behind `family_of`; `families/modeling/` the pruned model classes a
  checkpoint carries.
- `recovery/`: fine-tuning the pruned model (LoRA or full, cross-entropy or distillation), its data and teacher.
- `artifacts/`: everything written and read back: the checkpoint, the retry snapshot, `casp upgrade`, the caches,
  the GGUF files (`gguf/`) and compressed-tensors (`compressed_tensors/`), each with its size estimate.
- `eval/`: perplexity, zero-shot and efficiency behind `evaluate`. `report/`: report.json, report.md, the plots and
  the model card. `cli/`: `casp prune`, `eval`, `export`, `recover`, `upgrade`.
- `job/`: `run_job`, the whole job as its list of stages, and `job/sweep/`, a job with a target.

The root holds the foundation every room imports: `settings` (every setting, pydantic), `errors`, `run` (progress,
cancellation, timing), `units`, `rounding`, `numerics`, `model` (loading, the model's layers) and `data` (texts).
"""
