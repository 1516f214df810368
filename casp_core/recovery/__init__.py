"""Recovery after pruning: `train` fine-tunes the pruned model (LoRA merged into the weights, or full) on
cross-entropy or distillation; `data` its training text; `teacher` the dense model's top-k logits, computed once
and cached (docs/recovery.md).
"""
