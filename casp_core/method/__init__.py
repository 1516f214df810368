"""The paper's method, one module per step in its order: calibration (windows, layer inputs, C = E[YᵀY]),
interaction (Q = (WᵀW) ⊙ C), allocation (S_l and r_l; `temperature`: alpha "auto"), budget (heads and channels per
layer), selection (one layer's units by a solver of `solvers`), compensation, surgery, verification; `layer` one
layer's step through them, `experts` the same steps for a mixture of experts' layer, `placement` where the weights
are while it runs, `next_token` the loss the allocation and the evaluation share, `results` what it returns.
`prune.prune` runs the allocation, then `layer.prune_layer` over the layers, then surgery and verification.

It writes no files and knows no job, no artifact, no evaluation, no report and no recovery
(tests/test_architecture.py).
"""
