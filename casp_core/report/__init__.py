"""What a job hands back besides the model: report.json and report.md (`build` and its sections), the plots, the
model card, and what a published checkpoint says of its source (`publish`: local files by their name only).
"""
