"""The pruned model classes a checkpoint carries, one file per layout: transformers copies a checkpoint's modeling
file and its sibling `from .x import`s into the checkpoint and names it in `auto_map`, so these files stay one flat
folder under the names already handed out, and import nothing of casp_core (tests/test_architecture.py).
"""
