"""Batch jobs: settings (config), job files (file), the output lock and signals (guard), the single-machine run
(run) and the Ray executor (ray_executor); LLMProcessor for Ray Datasets (processor)."""
