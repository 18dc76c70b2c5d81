"""The seam between the attention node and its expert workers: one plane per file."""
