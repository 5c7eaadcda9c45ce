"""Evaluation with lm-evaluation-harness (`pip install 'tinyvllm[eval]'`): see lm_eval_model.py.

Nothing is imported here, so `import tinyvllm` never needs lm-eval; `import tinyvllm.eval.lm_eval_model` registers
the `tinyvllm` model with lm-eval.
"""
