"""Run a whole hetero-moe cluster on one machine: W expert workers and the attention server."""
